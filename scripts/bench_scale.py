#!/usr/bin/env python
"""Scale benchmark: K contributions a round against the real services, with simulated workers.

The four services run as operators run them (`apiary serve NAME` processes, 1 or 2 replicas of each) on the
local RabbitMQ and PostgreSQL and a local-folder store. The workers are simulated: ONE process runs K
`services.worker.Worker` objects (the real worker code: worker.online, heartbeats, the pinned, preferred and
pool queues, presigned downloads of the shard and the global weights, presigned upload of the result,
worker.done echoing the assignment's secret), each with an in-process trainer that returns the weights it
got (`NoOpTrainer`: no child process, no user code). A job of R rounds with K shards (min_workers =
max_workers = K) is submitted; rounds 2..R are measured (round 1 pays the shard downloads). R is --rounds (7: the
median of 6 rounds), or more for a small K, so that every K measures at least --contributions contributions: two
rounds of half a second (K = 100) say little on a shared machine. Round 2 is often the slowest (0.93-1.64x the
median of rounds 2-7 in nine runs at K = 1,000, 1.16x in the median one): with R = 3 the median of
rounds 2 and 3 was their mean, which a slow round 2 moved at K = 1,000 only (K = 100 measured 20 rounds).

Figures, for each K and replica count:
- round time: from a round's `started_at` to the next round's (the last round: to the job's end), the
  median over rounds 2..R (each round's in `round_s_each`; how many workers trained in each of rounds 1..R in
  `workers_each`);
- time per contribution: round time / K;
- busy time: the length of the union of the intervals in which at least one simulated worker was handling
  an assignment of that round (from taking its delivery to worker.done being confirmed by the broker),
  i.e. the time during which the workers' own work (downloads, no-op training, upload, report) was going on;
- control-plane time per contribution: (round time - busy time) / K: the time in the round when no worker
  had anything to do (assigning, aggregating, starting the next round), per contribution;
- phases: when the aggregator recorded the round's first and last contribution and when it closed the round (s
  after the round's start, medians): the start (assigning), the stretch of reports and the close (with two
  aggregator replicas, the one closing re-folds the contributions the other took);
- CPU seconds per round of each service (all its replicas, user + system from /proc/<pid>/stat), of the
  simulated workers' process, RabbitMQ and PostgreSQL, over rounds 2..R.

Reference in the same run, measured first: Flower 1.42's single-process simulation of K no-op clients
(scripts/bench_flower.py: the same toy model, 100k parameters, the weights returned as received; its round
time is the median time between consecutive rounds' ends), in a Python that has `flwr[simulation]`
(--flower-python; e.g. a venv with ray and flwr's own dependencies).

The broker is configured as `apiary broker setup` configures it: the exchange's queue policy (classic queues on
RabbitMQ's second storage, `queue-version` 2, the default from RabbitMQ 3.13) is set for the run and cleared after;
`--queue-version 1` measures classic queues as a RabbitMQ 3.12 or older makes them without it, `--queue-type
quorum` a deployment on quorum queues.

Usage: python scripts/bench_scale.py [--k 10 100 1000] [--replicas 1 2] [--rounds 7] [--contributions 2000]
                                     [--params 100000] [--queue-version 2] [--queue-type classic]
                                     [--repeat N] [--flower-python PY] [--plot docs/benchmarks/scale.png]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_round import _cpu_by_command, _cpu_seconds, admin, measure_flower  # noqa: E402

from apiary.status import TERMINAL  # noqa: E402
from services.app.broker_setup import apply_policy, remove_policy  # noqa: E402
from tests.fixtures.cluster import SERVICES, Cluster  # noqa: E402
from tests.toyjobs.toy import make_dataset  # noqa: E402

AMQP = os.environ.get("APIARY_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
POSTGRES = os.environ.get("APIARY_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
WORKERS_PER_CONNECTION = 100  # each worker holds 4 channels; RabbitMQ allows 2047 a connection


def _cpu_snapshot(processes: Mapping[str, subprocess.Popen[bytes]]) -> dict[str, dict[int, float]]:
    """CPU seconds so far by service (its replicas) and pid, and of RabbitMQ and PostgreSQL (a process per
    connection)."""
    cpu: dict[str, dict[int, float]] = {}
    for name, process in processes.items():
        cpu.setdefault(name.split("-")[0], {})[process.pid] = _cpu_seconds(process.pid)
    servers = _cpu_by_command(("beam.smp", "postgres"))
    cpu["rabbitmq"], cpu["postgresql"] = servers["beam.smp"], servers["postgres"]
    return cpu


def _cpu_spent(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, float]:
    """CPU seconds between two snapshots by service (a process that exited in between is not counted)."""
    return {kind: sum(t - before.get(kind, {}).get(pid, 0.0) for pid, t in pids.items())
            for kind, pids in after.items()}


def broker_open_files() -> int | None:
    """The open-file limit of the local RabbitMQ (its beam.smp process), or None if none is found here."""
    for limits in Path("/proc").glob("[0-9]*/limits"):
        try:
            if (limits.parent / "comm").read_text().strip() != "beam.smp":
                continue
            line = next(x for x in limits.read_text().splitlines() if x.startswith("Max open files"))
        except (OSError, StopIteration):
            continue
        return int(line.split()[3])
    return None


def check_broker(ks: list[int]) -> int | None:
    """Warn when the local broker cannot hold a file handle for every worker queue (3 a worker): past that,
    RabbitMQ 3.x closes and reopens queue index files and each persistent message costs it more, which a
    deployment sized as RabbitMQ's production checklist says (50,000 open files; deploy/docker-compose.yml)
    does not pay. The limit is recorded with the figures."""
    limit = broker_open_files()
    if limit is not None and limit < 3 * max(ks) + 1000:
        print(f"warning: the local RabbitMQ may open {limit} files, fewer than K = {max(ks)} workers' queues need "
              "(3 a worker); restart it with a higher limit to measure a broker sized as deployed, e.g. "
              "rabbitmqctl stop; su rabbitmq -s /bin/sh -c 'ulimit -n 20000; /usr/lib/rabbitmq/bin/rabbitmq-server"
              " -detached'", flush=True)
    return limit


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of these (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def simulated_workers(env: dict[str, str], k: int, log: Path, times: Path) -> subprocess.Popen[bytes]:
    """The one process of K simulated workers (this script's `--simulate K`)."""
    return subprocess.Popen([sys.executable, __file__, "--simulate", str(k), "--times", str(times)], cwd=REPO,
                            env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def profile(processes: Mapping[str, subprocess.Popen[bytes]], seconds: int, folder: Path) -> None:
    """Sample each process with py-spy for `seconds` (collapsed stacks, FOLDER/NAME.txt), in the background."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, process in processes.items():
        subprocess.Popen(["py-spy", "record", "--format", "raw", "--rate", "50", "--duration", str(seconds),
                          "--output", str(folder / f"{name}.txt"), "--pid", str(process.pid)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_rounds(cluster: Cluster, job_id: str, k: int, until: Callable[[], Any], what: str,
                interval: float = 2.0, stall: float = 60.0) -> Any:
    """Wait until `until()` is truthy and return it; RuntimeError if a round stays open `stall` s after its K-th
    contribution was recorded (no aggregator replica closes it), rather than waiting for its timeout."""

    def done_or_stalled() -> Any:
        value = until()
        if value:
            return value
        stuck = cluster.query(
            "SELECT a.round, max(c.received_at) AS last FROM aggregations a JOIN contributions c"
            " ON (c.job_id, c.round, c.attempt) = (a.job_id, a.round, a.attempt)"
            " WHERE a.job_id = $1 AND a.status = 'open' GROUP BY a.round HAVING count(*) >= $2", job_id, k)
        for row in stuck:
            if time.time() - row["last"] > stall:
                raise RuntimeError(f"round {row['round']} stalled: all {k} contributions recorded, the round still "
                                   f"open {stall:.0f} s later")
        return None

    return cluster.wait_for(done_or_stalled, 3600, what, interval=interval)


def run(k: int, replicas: int, rounds: int, params: int, tmp: Path, profile_to: Path | None = None,
        aggregators: int | None = None, heartbeat: float = 5.0, idle: float = 0.0,
        presence_rate: float | None = None, queue_type: str = "classic", queue_version: int = 2) -> dict[str, Any]:
    """One deployment (`replicas` of each service; `aggregators` of the aggregator if given), one job of
    `rounds` rounds and K contributions each; its figures (with `idle` seconds, the CPU per second of the K
    workers online before the job, too)."""
    db = f"apiary_bench_{uuid.uuid4().hex[:8]}"
    admin(f'CREATE DATABASE "{db}"')
    exchange = f"apiary_bench_{uuid.uuid4().hex[:8]}"
    if queue_version == 2:  # the broker as `apiary broker setup` configures it
        apply_policy(exchange, "/")
    base = tmp / f"k{k}-r{replicas}"
    cluster = Cluster(base, AMQP, exchange, POSTGRES.rsplit("/", 1)[0] + f"/{db}", f"file://{base / 'store'}", "",
                      queue_type=queue_type)
    # The deployed defaults (heartbeats every 5 s, offline after 20 s), or heartbeats every `heartbeat` s.
    deployed = {"APIARY_HEARTBEAT_INTERVAL": str(heartbeat), "APIARY_WORKER_OFFLINE_AFTER": str(4 * heartbeat),
                "APIARY_PROGRESS_INTERVAL": "1"}
    if presence_rate is not None:  # the fleet's heartbeat budget (apiary.pace); default the deployed one
        deployed["APIARY_PRESENCE_RATE"] = str(presence_rate)
    times = base / "times.jsonl"
    try:
        cluster.start(workers=0, **deployed)
        for name in SERVICES:
            count = aggregators if name == "aggregator" and aggregators is not None else replicas
            for index in range(2, count + 1):
                cluster.start_replica(name, index, **deployed)
        sim = simulated_workers(cluster.env(**deployed), k, cluster.logs / "simulated.log", times)
        cluster.processes["simulated"] = sim
        cluster.wait_workers([f"sim-{i:04d}" for i in range(k)], timeout=600)
        idle_profile = None if profile_to is None else profile_to / f"idle-k{k}-r{replicas}"
        idle_cpu = _idle_cpu(cluster, idle, idle_profile) if idle else None
        job_id = f"scale-k{k}-{uuid.uuid4().hex[:6]}"
        cluster.publish_job({
            "job_id": job_id, "name": job_id, "entrypoint": "tests.toyjobs.identity:fl_train_model",
            "dataset": str(make_dataset(base / "data", 2 * k)), "config": {"params": params},
            "distributed": {"num_rounds": rounds, "min_workers": k, "max_workers": k,
                            "aggregation_timeout": 1800},
        })
        wait_rounds(cluster, job_id, k, lambda: cluster.query(
            "SELECT 1 FROM rounds WHERE job_id = $1 AND round = 2", job_id), "round 2", interval=0.05)
        before = _cpu_snapshot(cluster.processes)
        if profile_to is not None:
            profile(cluster.processes, 30, profile_to / f"k{k}-r{replicas}")
        job = wait_rounds(cluster, job_id, k, lambda: (j := cluster.job(job_id)) and j["status"] in TERMINAL and j,
                          f"job {job_id} to end")
        after = _cpu_snapshot(cluster.processes)
        if job["status"] != "completed":
            raise RuntimeError(f"benchmark job {job['status']}: {job['reason']}")
        figures = _figures(cluster, job_id, k, rounds, times, _cpu_spent(before, after))
        if idle_cpu is not None:
            figures["idle_cpu_s_per_s"] = idle_cpu
        return figures
    finally:
        cluster.stop_all()
        from tests.fixtures.services import delete_rabbit_namespace

        delete_rabbit_namespace(AMQP, exchange)
        if queue_version == 2:
            remove_policy(exchange, "/")
        admin(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        shutil.rmtree(base, ignore_errors=True)


def _idle_cpu(cluster: Cluster, seconds: float, profile_to: Path | None = None) -> dict[str, float]:
    """CPU seconds per second of each process while the K workers are online and no job runs (their heartbeats,
    the broker's upkeep of their connections, channels and queues): what every second of a round costs
    besides its work (each process sampled into `profile_to` meanwhile, if given)."""
    time.sleep(min(seconds, 10))  # the workers' online announcements settle
    before = _cpu_snapshot(cluster.processes)
    if profile_to is not None:
        profile(cluster.processes, int(seconds), profile_to)
    time.sleep(seconds)
    spent = _cpu_spent(before, _cpu_snapshot(cluster.processes))
    return {n: round(v / seconds, 3) for n, v in sorted(spent.items(), key=lambda i: -i[1])}


def _figures(cluster: Cluster, job_id: str, k: int, rounds: int, times: Path,
             cpu: dict[str, float]) -> dict[str, Any]:
    starts = {r["round"]: r["started_at"] for r in cluster.query(
        "SELECT round, started_at FROM rounds WHERE job_id = $1 AND attempt = 1", job_id)}
    end = cluster.query("SELECT updated_at FROM jobs WHERE job_id = $1", job_id)[0]["updated_at"]
    intervals: dict[int, list[tuple[float, float]]] = {}
    trainers: dict[int, set[str]] = {}  # the workers that trained in each round
    gc_seen: list[tuple[float, float, int]] = []  # (done, gc seconds so far, full collections so far)
    for line in times.read_text().splitlines():
        row = json.loads(line)
        if row["job_id"] == job_id:
            intervals.setdefault(row["round"], []).append((row["taken"], row["done"]))
            trainers.setdefault(row["round"], set()).add(row["worker"])
            if row["round"] >= 2:
                gc_seen.append((row["done"], row["gc_s"], row["gc_full"]))
    measured = range(2, rounds + 1)
    round_s = [starts.get(r + 1, end) - starts[r] for r in measured]
    busy_s = [min(busy_time(intervals.get(r, [])), t) for r, t in zip(measured, round_s, strict=True)]
    contributions = [len(intervals.get(r, [])) for r in measured]
    if any(c != k for c in contributions):
        raise RuntimeError(f"expected {k} contributions a round, the simulated workers made {contributions}")
    median = statistics.median(round_s)
    control = statistics.median((t - b) / k for t, b in zip(round_s, busy_s, strict=True))
    return {"round_s": round(median, 3), "per_contribution_ms": round(median / k * 1000, 2),
            "busy_s": round(statistics.median(busy_s), 3), "control_per_contribution_ms": round(control * 1000, 2),
            "phases_s": _phases(cluster, job_id, starts, measured),
            "cpu_s_per_round": {n: round(v / len(round_s), 2) for n, v in sorted(cpu.items(), key=lambda i: -i[1])},
            "simulated_gc_per_round": _gc_per_round(gc_seen, len(round_s)),
            "rounds": len(round_s), "round_s_each": [round(t, 3) for t in round_s],
            "workers_each": [len(trainers.get(r, ())) for r in range(1, rounds + 1)]}


def _phases(cluster: Cluster, job_id: str, starts: Mapping[int, float], measured: range) -> dict[str, float]:
    """Where a round's time goes, from the rows the services write (medians over the measured rounds, s after
    the round's start): its first and last contribution recorded by the aggregator, and the round closed."""
    marks: dict[str, list[float]] = {"first_recorded": [], "last_recorded": [], "closed": []}
    for r in measured:
        row = cluster.query(
            "SELECT MIN(c.received_at) AS first_recorded, MAX(c.received_at) AS last_recorded,"
            " MAX(a.closed_at) AS closed FROM contributions c JOIN aggregations a USING (job_id, round, attempt)"
            " WHERE c.job_id = $1 AND c.round = $2 AND c.attempt = 1", job_id, r)[0]
        for name, values in marks.items():
            if row[name] is not None:
                values.append(row[name] - starts[r])
    return {name: round(statistics.median(values), 3) for name, values in marks.items() if values}


def _gc_per_round(seen: list[tuple[float, float, int]], rounds: int) -> dict[str, float]:
    """The simulated workers' garbage-collection seconds and full collections per measured round (from the first
    report of round 2 to the last of round R: a close lower bound)."""
    seen.sort()
    (_, s0, f0), (_, s1, f1) = seen[0], seen[-1]
    return {"seconds": round((s1 - s0) / rounds, 3), "full_collections": round((f1 - f0) / rounds, 2)}


# --- the simulated workers (run with --simulate K) ------------------------------------------------------


def _no_op_trainer(times: Path) -> Any:
    """A trainer that returns the weights it got, in-process, recording when each assignment was taken."""
    from safetensors.torch import save_file

    from apiary.trainers import TrainCall, TrainResult, UserCodeRunner
    from tests.toyjobs.identity import fl_init_weights

    class NoOpTrainer(UserCodeRunner):
        """Training is the identity; init writes the toy's weights; no evaluation."""

        def __init__(self) -> None:  # no child process: nothing of UserCodeRunner's own is used
            pass

        @property
        def pid(self) -> int | None:
            return None

        async def start(self) -> None:
            return None

        async def stop(self) -> None:
            return None

        async def train(self, call: TrainCall, *, timeout: float | None = None,
                        on_metrics: Any = None) -> TrainResult:
            data = Path(call.weights_path).read_bytes()
            Path(call.result_path).write_bytes(data)
            return TrainResult(samples=int(call.dataset["num_samples"]), size=len(data),
                               sha256=hashlib.sha256(data).hexdigest())

        async def init_task(self, call: TrainCall, *, timeout: float | None = None) -> bool:
            save_file(fl_init_weights(call.env), call.result_path)
            return True

        async def evaluate_task(self, call: TrainCall, *, timeout: float | None = None) -> None:
            return None

    return NoOpTrainer()


async def simulate(k: int, times: Path) -> None:
    """K workers in this process, on buses of WORKERS_PER_CONNECTION workers each, until SIGTERM."""
    import signal

    from apiary.bus import make_bus
    from apiary.settings import Settings
    from services.worker import Worker

    GC.install()
    settings = Settings()
    trainer = _no_op_trainer(times)
    buses, workers = [], []
    for first in range(0, k, WORKERS_PER_CONNECTION):
        bus = make_bus(settings.resolved_bus_url(), exchange=settings.exchange, queue_type=settings.queue_type,
                       delivery_limit=settings.queue_delivery_limit)
        await bus.connect()
        buses.append(bus)
        for i in range(first, min(k, first + WORKERS_PER_CONNECTION)):
            worker = Worker(bus, settings, worker_id=f"sim-{i:04d}", runner=trainer)
            _record_assignments(worker, times)
            await worker.start()
            workers.append(worker)
    # K workers' objects in one heap (each real worker is a process of its own): Python's full collections,
    # which grow more frequent with K, would each walk all of them, K^2 a round in this process alone (1.2 s
    # a round at K = 1,000 before this). What exists once the workers are up is exempted from collection.
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for worker in workers:
        await worker.stop()
    for bus in buses:
        await bus.close()


class GcClock:
    """The time this process spent in Python's cyclic garbage collector, and its full collections."""

    def __init__(self) -> None:
        self.seconds, self.full, self._started = 0.0, 0, 0.0

    def install(self) -> None:
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.full += info["generation"] == 2


GC = GcClock()


def _record_assignments(worker: Any, times: Path) -> None:
    """Append (job, round, worker, taken, done) of each training assignment the worker handles to `times`."""
    handle = worker.on_assignment

    async def timed(assignment: Any, delivery: Any) -> None:
        taken = time.time()
        await handle(assignment, delivery)
        if assignment.task == "train":
            with times.open("a") as out:
                out.write(json.dumps({"job_id": assignment.job_id, "round": assignment.round,
                                      "worker": worker.worker_id, "taken": taken, "done": time.time(),
                                      "gc_s": GC.seconds, "gc_full": GC.full}) + "\n")

    worker.on_assignment = timed


# --- report --------------------------------------------------------------------------------------------


def plot(results: dict[int, dict[int, dict[str, Any]]], flower: dict[int, float], path: Path) -> None:
    """Round time against K, one line per replica count, Flower's points beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for replicas, by_k in sorted(results.items()):
        ks = sorted(by_k)
        single = replicas > 1 and any(by_k[k].get("aggregators") == 1 for k in ks)
        ax.plot(ks, [by_k[k]["round_s"] for k in ks], marker="o",
                label=(f"Apiary, {replicas} of scheduler, sharder, tracker; 1 aggregator" if single
                       else f"Apiary, {replicas} replica{'s' if replicas > 1 else ''} of each service"))
    if flower:
        ks = sorted(flower)
        ax.plot(ks, [flower[k] for k in ks], marker="s", linestyle="--", label="Flower 1.42 simulation")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("contributions per round (K)")
    ax.set_ylabel("round time (s)")
    ax.set_title("Round time against K (simulated no-op workers)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def report(results: dict[int, dict[int, dict[str, Any]]], flower: dict[int, float]) -> None:
    """The figures the issue asks for."""
    for replicas, by_k in sorted(results.items()):
        for k, r in sorted(by_k.items()):
            cpu = ", ".join(f"{n} {v:.2f}" for n, v in r["cpu_s_per_round"].items())
            print(f"replicas={replicas} K={k}: round {r['round_s']:.2f} s, {r['per_contribution_ms']:.1f} ms per "
                  f"contribution, busy {r['busy_s']:.2f} s, control plane {r['control_per_contribution_ms']:.2f} ms "
                  f"per contribution; CPU s per round: {cpu}")
            if "phases_s" in r:
                p = r["phases_s"]
                print(f"  after the round's start: first report recorded +{p['first_recorded']:.2f} s, last "
                      f"+{p['last_recorded']:.2f} s, round closed +{p['closed']:.2f} s")
        if 1000 in by_k and 100 in by_k:
            big, small = (by_k[k].get("round_s_runs", {"0": by_k[k]["round_s"]}) for k in (1000, 100))
            ratios = [big[i] / small[i] for i in sorted(big.keys() & small.keys(), key=int)]
            each = f" (each repeat: {', '.join(f'{r:.2f}' for r in ratios)})" if len(ratios) > 1 else ""
            print(f"replicas={replicas}: round time K=1000 / K=100 = "
                  f"{statistics.median(ratios):.2f}{each} (target <= 11)")
    for k, seconds in sorted(flower.items()):
        print(f"Flower 1.42 simulation, K={k} no-op clients: {seconds:.2f} s a round")
        for replicas, by_k in sorted(results.items()):
            if k in by_k:
                print(f"  replicas={replicas}: Apiary round / Flower round = {by_k[k]['round_s'] / seconds:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7,
                        help="rounds of each job, at least (round 1 not measured): the median of 6 by default, since "
                             "round 2 is often the slowest")
    parser.add_argument("--contributions", type=int, default=2000,
                        help="contributions each K measures at least: a small K runs more rounds than --rounds")
    parser.add_argument("--params", type=int, default=100_000,
                        help="parameters of the toy model's weights (scripts/bench_flower.py's model has 100k)")
    parser.add_argument("--flower-python", help="a Python with flwr[simulation]: measure Flower's reference now")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "benchmarks" / "scale.png")
    parser.add_argument("--heartbeat", type=float, default=5.0,
                        help="workers' heartbeat interval, s (the deployed default: 5; offline after 4 of them)")
    parser.add_argument("--presence-rate", type=float,
                        help="the fleet's heartbeats a second before they are paced (default: the deployed 50; "
                             "1e9 beats at --heartbeat whatever the fleet, as before apiary.pace)")
    parser.add_argument("--idle", type=float, default=0.0,
                        help="seconds to measure each process's CPU with the K workers online before the job")
    parser.add_argument("--queue-type", choices=("classic", "quorum"), default="classic",
                        help="APIARY_QUEUE_TYPE of the deployment (every queue a quorum queue with quorum)")
    parser.add_argument("--queue-version", type=int, choices=(1, 2), default=2,
                        help="classic queues' storage: 2 as `apiary broker setup` configures the broker (the "
                             "exchange's queue policy), 1 as a RabbitMQ 3.12 or older makes them without it")
    parser.add_argument("--one-aggregator", action="store_true",
                        help="one aggregator whatever --replicas says (the others replicated)")
    parser.add_argument("--results", type=Path, default=REPO / "docs" / "benchmarks" / "scale.json",
                        help="where the figures are written (JSON); with --keep, earlier ones there are kept")
    parser.add_argument("--keep", action="store_true", help="add to the figures already in --results")
    parser.add_argument("--profile", type=Path,
                        help="py-spy each process for 30 s from round 2 on (and through --idle), into this folder")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure every K this many times, in turn; the figures are the median run's, the ratio "
                             "the median of each repeat's")
    parser.add_argument("--simulate", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--times", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # The policy of these deployments (apiary.policy): the toy job's entrypoint, data under the temporary folder.
    os.environ.setdefault("APIARY_ALLOWED_ENTRYPOINTS", json.dumps(["tests.toyjobs.*"]))
    os.environ.setdefault("APIARY_DATA_ROOTS", json.dumps([tempfile.gettempdir()]))
    if args.simulate:
        asyncio.run(simulate(args.simulate, args.times))
        return
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: round 1 pays the shard downloads and is not measured")
    results, flower = load(args.results) if args.keep else ({}, {})
    if args.flower_python:
        flower.update(measure_flower(args.flower_python, args.k, args.rounds))
        print("Flower 1.42 simulation: " + ", ".join(f"K={k} {v:.2f} s" for k, v in sorted(flower.items())), flush=True)
    open_files = check_broker(args.k)
    runs: dict[tuple[int, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="apiary-scale-") as tmp:
        # Each repeat measures every K in turn, so that a ratio compares runs taken minutes apart, not a
        # quiet spell of this shared machine with a busy one.
        for repeat in range(args.repeat):
            for replicas in args.replicas:
                for k in args.k:
                    try:
                        figures = run(k, replicas, rounds_for(k, args.rounds, args.contributions), args.params,
                                      Path(tmp), args.profile, 1 if args.one_aggregator else None, args.heartbeat,
                                      args.idle, args.presence_rate, args.queue_type, args.queue_version)
                    except RuntimeError as e:
                        print(f"replicas={replicas} K={k}: {e}", flush=True)
                        continue
                    figures["aggregators"] = 1 if args.one_aggregator else replicas
                    figures["heartbeat_s"] = args.heartbeat
                    figures["presence_rate"] = args.presence_rate
                    figures["queue_type"] = args.queue_type
                    figures["queue_version"] = args.queue_version
                    figures["repeat"] = repeat
                    figures["broker_open_files"] = open_files
                    print(f"replicas={replicas} K={k}: {json.dumps(figures)}", flush=True)
                    runs.setdefault((replicas, k), []).append(figures)
                    results.setdefault(replicas, {})[k] = median_run(runs[(replicas, k)])
                    save(args.results, results, flower)
    save(args.results, results, flower)
    report(results, flower)
    plot(results, flower, args.plot)


def rounds_for(k: int, rounds: int, contributions: int) -> int:
    """The rounds of a job of K shards: `rounds`, or enough that rounds 2.. hold `contributions` contributions."""
    return max(rounds, -(-contributions // k) + 1)


def median_run(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median round time (the faster one of an even count), with every run's round time beside it by
    repeat (a ratio pairs runs of the same repeat: a run that failed leaves its repeat out)."""
    ordered = sorted(figures, key=lambda f: f["round_s"])
    return {**ordered[(len(ordered) - 1) // 2], "round_s_runs": {str(f["repeat"]): f["round_s"] for f in figures}}


def save(path: Path, results: dict[int, dict[int, dict[str, Any]]], flower: dict[int, float]) -> None:
    """Write the figures (JSON)."""
    path.write_text(json.dumps({"apiary": results, "flower": flower}, indent=1, sort_keys=True) + "\n")


def load(path: Path) -> tuple[dict[int, dict[int, dict[str, Any]]], dict[int, float]]:
    """The figures written by `save` (none if there is no such file)."""
    if not path.is_file():
        return {}, {}
    data = json.loads(path.read_text())
    apiary = {int(r): {int(k): v for k, v in by_k.items()} for r, by_k in data["apiary"].items()}
    return apiary, {int(k): float(v) for k, v in data["flower"].items()}


if __name__ == "__main__":
    main()
