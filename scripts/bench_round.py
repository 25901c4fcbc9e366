#!/usr/bin/env python
"""Round overhead benchmark: median round time of a job whose entrypoint returns the weights it got.

Runs the deployed stack as separate processes (scheduler, sharder, aggregator, tracker and K workers)
on the local RabbitMQ and PostgreSQL and a moto S3 server, with a ~100k-parameter model, K shards
of one sample-set each and K workers, for R rounds; reports the median time between round starts
(round 1, which pays the workers' first imports and shard downloads, is left out). With S3 it then
measures the floor that the S3 server sets: the same round's 3K+1 requests alone, with no Apiary
process running.

Reference (from the issue, same machines): Flower 1.42's simulation engine, 0.10 s (K=4) and
0.21 s (K=16) per round for this model; the goal is a quarter of that or less.

Usage: python scripts/bench_round.py [--k 4 16] [--rounds 20] [--storage s3|file] [--flower-python PY]
                                    [--against REF [--pairs N]]

With --flower-python (a Python that has flwr[simulation], see scripts/bench_flower.py), Flower's
figures are measured in the same session, first, and are the reference; without it, the issue's.

With --against REF (a commit), the same benchmark of that commit's code (its own script, from a git
worktree) runs beside this one's, in N pairs, alternating which goes first; it prints each pair's
medians and, per K, the median of the pairs' ratios this/REF: on a shared machine only pairs measured
back to back compare. Give such comparisons --rounds 200: a 20-round median (about a second of rounds at K=4)
moves with whatever else the machine runs, by up to a third from one pair to the next.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import asyncpg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures import s3server  # noqa: E402
from tests.fixtures.cluster import Cluster  # noqa: E402
from tests.fixtures.processes import children  # noqa: E402
from tests.toyjobs.toy import make_dataset  # noqa: E402

from bench_record import add_json_argument, record  # noqa: E402

AMQP = os.environ.get("APIARY_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
POSTGRES = os.environ.get("APIARY_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
FLOWER = {4: 0.10, 16: 0.21}
BREAKDOWN = bool(os.environ.get("APIARY_BENCH_BREAKDOWN"))  # each round's timeline, and CPU per process kind
CPU = BREAKDOWN  # CPU per process kind (always with --against)
CPU_LINE = "  CPU ms per round"
LAST_CPU: dict[str, float] = {}  # the last run's CPU ms per round by process kind
MOTO: list[subprocess.Popen[bytes]] = []


def admin(sql: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(POSTGRES)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


def _cpu_seconds(pid: int, descendants: bool = True) -> float:
    """User + system CPU of a process and (unless `descendants` is False) of its live descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    pids, total = [pid], 0.0
    while pids:
        p = pids.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
        if descendants:
            pids += children(p)
    return total


def _cpu_by_command(names: tuple[str, ...]) -> dict[str, dict[int, float]]:
    """CPU seconds of each process whose command name is one of `names` (RabbitMQ, PostgreSQL), by pid."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, dict[int, float]] = {name: {} for name in names}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, tail = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        name = head.split("(", 1)[1]
        if name in out:
            fields = tail.split()
            out[name][int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all cores), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(processes: dict[str, subprocess.Popen[bytes]]) -> dict[str, dict[int, float]]:
    """CPU seconds so far by kind and pid: each Apiary process kind, moto, RabbitMQ, PostgreSQL
    (one process per connection), and the whole machine (pid 0)."""
    cpu: dict[str, dict[int, float]] = {}
    for name, process in processes.items():
        if name.startswith("worker"):
            # The worker's process alone, and its training child (the user's code, fed over a pipe) apart.
            alone = _cpu_seconds(process.pid, descendants=False)
            cpu.setdefault("worker", {})[process.pid] = alone
            cpu.setdefault("trainer", {})[process.pid] = _cpu_seconds(process.pid) - alone
        else:
            cpu.setdefault(name, {})[process.pid] = _cpu_seconds(process.pid)
    servers = _cpu_by_command(("beam.smp", "postgres"))
    cpu["rabbitmq"], cpu["postgresql"] = servers["beam.smp"], servers["postgres"]
    cpu["machine"] = {0: _machine_busy_seconds()}
    return cpu


def cpu_spent(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, float]:
    """CPU seconds spent between two snapshots, by kind (processes that exited in between are not
    counted; those that started are, whole)."""
    return {kind: sum(t - before.get(kind, {}).get(pid, 0.0) for pid, t in pids.items())
            for kind, pids in after.items()}


def _wait_row(database_url: str, sql: str, *args: Any, timeout: float = 600) -> None:
    """Poll one connection every 20 ms until `sql` returns a row (a new connection per poll would cost the
    database more CPU than the query, and a long interval would count the services' idle CPU)."""

    async def wait() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            deadline = time.monotonic() + timeout
            while await conn.fetchrow(sql, *args) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no row from {sql} {args} after {timeout} s")
                await asyncio.sleep(0.02)
        finally:
            await conn.close()

    asyncio.run(wait())


def run(k: int, rounds: int, tmp: Path, endpoint: str, storage: str = "s3",
        env: dict[str, str] | None = None) -> list[float]:
    """The durations of rounds 2..N, the processes started with `env` too; with CPU, the CPU ms per round each
    process kind spent is in LAST_CPU."""
    db = f"apiary_bench_{uuid.uuid4().hex[:8]}"
    admin(f'CREATE DATABASE "{db}"')
    exchange = f"apiary_bench_{uuid.uuid4().hex[:8]}"
    storage_url = (f"s3://bench-{uuid.uuid4().hex[:8]}/runs" if storage == "s3"
                   else f"file://{tmp / f'storage-k{k}'}")
    cluster = Cluster(tmp / f"k{k}", AMQP, exchange, POSTGRES.rsplit("/", 1)[0] + f"/{db}", storage_url, endpoint)
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
    try:
        # The deployed defaults for heartbeats and progress reports (the test cluster beats every second).
        cluster.start(workers=k, APIARY_HEARTBEAT_INTERVAL="5", APIARY_PROGRESS_INTERVAL="1", **(env or {}))
        dataset = make_dataset(tmp / f"data-{k}", k * 4)
        job_id = f"bench-k{k}-{uuid.uuid4().hex[:6]}"
        cluster.publish_job({
            "job_id": job_id, "name": f"bench-k{k}", "entrypoint": "tests.toyjobs.identity:fl_train_model",
            "dataset": str(dataset), "config": {"params": 100_000},
            "distributed": {"num_rounds": rounds, "min_workers": k, "max_workers": k, "aggregation_timeout": 600},
        })
        before: dict[str, dict[int, float]] = {}
        if CPU:
            # CPU per round from round 2 on (round 1 pays imports and shard downloads) to the job's end.
            _wait_row(cluster.database_url, "SELECT 1 FROM rounds WHERE job_id = $1 AND round = 2", job_id)
            before = cpu_snapshot({**cluster.processes, "moto": MOTO[0]} if MOTO else cluster.processes)
            _wait_row(cluster.database_url, "SELECT 1 FROM jobs WHERE job_id = $1 AND status = ANY($2::text[])",
                      job_id, ["completed", "failed", "cancelled", "rejected"])
            after = cpu_snapshot({**cluster.processes, "moto": MOTO[0]} if MOTO else cluster.processes)
        # Polled rarely: each poll is a new PostgreSQL connection, CPU the rounds would compete with.
        job = cluster.wait_job(job_id, timeout=600, interval=3)
        if job["status"] != "completed":
            raise RuntimeError(f"benchmark job {job['status']}: {job['reason']}")
        starts = [r["started_at"] for r in cluster.query(
            "SELECT started_at FROM rounds WHERE job_id = $1 ORDER BY round", job_id)]
        if BREAKDOWN:
            closed = {r["round"]: r["closed_at"] for r in cluster.query(
                "SELECT round, closed_at FROM aggregations WHERE job_id = $1", job_id)}
            received: dict[int, list[float]] = {}
            for r in cluster.query("SELECT round, received_at FROM contributions WHERE job_id = $1", job_id):
                received.setdefault(r["round"], []).append(r["received_at"])
            for i, start in enumerate(starts[1:], start=2):
                got = sorted(received[i])
                nxt = starts[i] if i < len(starts) else None
                print(f"  round {i}: first result +{(got[0] - start) * 1000:.0f} ms,"
                      f" last +{(got[-1] - start) * 1000:.0f} ms, closed +{(closed[i] - start) * 1000:.0f} ms"
                      + (f", next round +{(nxt - start) * 1000:.0f} ms" if nxt else ""))
        end = cluster.query("SELECT updated_at FROM jobs WHERE job_id = $1", job_id)[0]["updated_at"]
        LAST_CPU.clear()
        if CPU:
            per_round = {kind: spent / max(1, len(starts) - 1) for kind, spent in cpu_spent(before, after).items()}
            print(f"{CPU_LINE} (rounds 2..N; 2 cores give 2000 ms per wall second):",
                  ", ".join(f"{kind} {v * 1000:.0f}" for kind, v in sorted(per_round.items(), key=lambda kv: -kv[1])),
                  flush=True)
            print(f"  CPU ms per contribution (per round / K={k}):",
                  ", ".join(f"{kind} {v * 1000 / k:.1f}" for kind, v in sorted(per_round.items(), key=lambda kv: -kv[1])
                            if kind != "machine"), flush=True)
            LAST_CPU.update({kind: v * 1000 for kind, v in per_round.items()})
        return [b - a for a, b in zip(starts, [*starts[1:], end], strict=True)][1:]
    finally:
        cluster.stop_all()
        from tests.fixtures.services import delete_rabbit_namespace

        delete_rabbit_namespace(AMQP, exchange)
        admin(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def storage_floor(endpoint: str, k: int, rounds: int, size: int = 400_000) -> tuple[float, float]:
    """What a round's S3 traffic alone takes on this S3 server, with no Apiary process running: the
    3K+1 requests of one round (K workers each GET the global weights and PUT their result, then the
    K results are read and the new global weights written), from K threads of this process with
    presigned URLs as the workers use them. Returns the median wall time per round and the server's
    CPU per round (seconds)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket = f"floor-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    body = os.urandom(size)
    s3.put_object(Bucket=bucket, Key="global", Body=body)

    def url(method: str, key: str) -> str:
        return str(s3.generate_presigned_url("get_object" if method == "GET" else "put_object",
                                             Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600))

    def get(address: str) -> None:
        with urllib.request.urlopen(address, timeout=60) as response:
            response.read()

    def put(address: str) -> None:
        request = urllib.request.Request(address, data=body, method="PUT",
                                         headers={"Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()

    reads, writes = [url("GET", "global")] * k, [url("PUT", f"result-{i}") for i in range(k)]
    results, new_global = [url("GET", f"result-{i}") for i in range(k)], url("PUT", "global-next")

    def worker(i: int) -> None:
        get(reads[i])
        put(writes[i])

    times = []
    cpu = _cpu_seconds(MOTO[0].pid)
    with concurrent.futures.ThreadPoolExecutor(k) as pool:
        for _ in range(rounds):
            start = time.perf_counter()
            list(pool.map(worker, range(k)))
            list(pool.map(get, results))
            put(new_global)
            times.append(time.perf_counter() - start)
    cpu = _cpu_seconds(MOTO[0].pid) - cpu
    return statistics.median(times), cpu / rounds


def measure_flower(python: str, ks: list[int], rounds: int) -> dict[int, float]:
    """Median round time of Flower's simulation engine for each K, by scripts/bench_flower.py."""
    out = subprocess.run([python, str(REPO / "scripts" / "bench_flower.py"), "--k", *map(str, ks),
                          "--rounds", str(rounds)], capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"bench_flower.py failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    return {int(k): float(v["median_s"]) for k, v in figures.items()}


def checkout(ref: str, folder: Path) -> Path:
    """A git worktree of commit `ref` (removed with `git worktree remove` by the caller)."""
    tree = folder / f"against-{ref[:12]}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), ref], check=True,
                   capture_output=True, text=True)
    return tree


# Runs another checkout's bench_round.py with this one's CPU accounting (its training child counted, and apart).
_OTHER = """
import importlib.util, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))  # its own helpers (bench_record)
spec = importlib.util.spec_from_file_location("bench_round_other", sys.argv[1])
other = importlib.util.module_from_spec(spec)
spec.loader.exec_module(other)
exec(sys.argv[2], other.__dict__)
sys.argv = [sys.argv[1], *sys.argv[3:]]
other.main()
"""


def run_other(tree: Path, k: int, rounds: int, storage: str) -> tuple[float, dict[str, float]]:
    """Median round time of the benchmark in another checkout (its own script and code), in seconds, and its CPU
    milliseconds per round by process kind (empty without APIARY_BENCH_BREAKDOWN)."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'shared'}{os.pathsep}{tree}"}
    # Its run measured as here (its processes' CPU counted the same way, from round 2 to the job's end), its
    # S3 floor left out (as here).
    accounting = "\n\n".join([
        "from __future__ import annotations",
        f"CPU, CPU_LINE, LAST_CPU = True, {CPU_LINE!r}, {{}}",
        *(inspect.getsource(f) for f in (children, _cpu_seconds, cpu_snapshot, _wait_row, run)),
        "def storage_floor(*args, **kwargs):\n    return 1.0, 0.0\n"])
    out = subprocess.run([sys.executable, "-c", _OTHER, str(tree / "scripts" / "bench_round.py"), accounting,
                          "--k", str(k), "--rounds", str(rounds), "--storage", storage], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=3600, check=False)
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"bench_round.py of {tree.name} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    cpu: dict[str, float] = {}
    for line in out.stdout.splitlines():
        if line.startswith(CPU_LINE):
            items = (item.rsplit(" ", 1) for item in line.split(":", 1)[1].split(", "))
            cpu = {kind.strip(): float(v) for kind, v in items}
    # Its figures are its last JSON line ("figures written to ..." may follow it).
    figures = [line for line in out.stdout.splitlines() if line.startswith("{")][-1]
    return float(json.loads(figures)[str(k)]["median_s"]), cpu


def paired(args: argparse.Namespace, endpoint: str, tmp: Path) -> dict[int, dict[str, Any]]:
    """`args.pairs` groups of runs, this code and each `args.against` commit's, for each K, the order rotating from
    one group to the next; each group's medians and ratios this/REF, and the CPU each process kind spent per
    contribution (median over the groups)."""
    trees = {ref: checkout(ref, tmp) for ref in args.against}
    names = ["this", *args.against]
    medians: dict[int, dict[str, list[float]]] = {k: {name: [] for name in names} for k in args.k}
    cpus: dict[int, dict[str, list[dict[str, float]]]] = {k: {name: [] for name in names} for k in args.k}

    def measure(name: str, k: int) -> tuple[float, dict[str, float]]:
        if name == "this":
            durations = run(k, args.rounds, tmp, endpoint, args.storage)
            return statistics.median(durations), dict(LAST_CPU)
        return run_other(trees[name], k, args.rounds, args.storage)

    try:
        for i in range(args.pairs):
            for k in args.k:
                order = names[i % len(names):] + names[:i % len(names)]
                for name in order:
                    median, cpu = measure(name, k)
                    medians[k][name].append(median)
                    cpus[k][name].append(cpu)
                print(f"group {i + 1} K={k}: " + ", ".join(
                    f"{name} {medians[k][name][-1] * 1000:.1f} ms" for name in names) + "; ratios " + ", ".join(
                    f"this/{ref} {medians[k]['this'][-1] / medians[k][ref][-1]:.3f}" for ref in args.against),
                    flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    summary: dict[int, dict[str, Any]] = {}
    for k in args.k:
        ms = medians[k]
        summary[k] = {f"{name}_s": round(statistics.median(ms[name]), 4) for name in names}
        for ref in args.against:
            ratios = sorted(new / old for new, old in zip(ms["this"], ms[ref], strict=True))
            summary[k][f"ratio_{ref}"] = round(statistics.median(ratios), 3)
            print(f"K={k}: this {summary[k]['this_s'] * 1000:.1f} ms, {ref} {summary[k][f'{ref}_s'] * 1000:.1f} ms"
                  f" (medians of {len(ratios)} runs); ratio this/{ref} median {statistics.median(ratios):.3f}"
                  f" (min {ratios[0]:.3f}, max {ratios[-1]:.3f})", flush=True)
        kinds = sorted({kind for name in names for cpu in cpus[k][name] for kind in cpu if kind != "machine"})
        if kinds:
            print(f"  K={k} CPU ms per contribution (median over runs; rabbitmq and postgresql are the servers'"
                  " whole CPU, other clients' included):", flush=True)
            for name in names:
                per = {kind: statistics.median(cpu.get(kind, 0.0) for cpu in cpus[k][name]) / k for kind in kinds}
                summary[k][f"{name}_cpu_ms_per_contribution"] = {kind: round(v, 2) for kind, v in per.items()}
                print(f"    {name:>12}: " + ", ".join(f"{kind} {v:.1f}" for kind, v in per.items())
                      + f", total {sum(per.values()):.1f}", flush=True)
    return summary


# The processes whose CPU is Apiary's own (not moto's, RabbitMQ's or PostgreSQL's).
APIARY_KINDS = ("scheduler", "sharder", "aggregator", "tracker", "worker", "trainer")


def metrics_cost(args: argparse.Namespace, endpoint: str, tmp: Path) -> dict[int, dict[str, Any]]:
    """`args.metrics_pairs` pairs of runs per K, metrics off and on; the Apiary processes' CPU per round and the
    median round time of each, and the median ratios on/off."""
    on = {"APIARY_METRICS": "prometheus", "APIARY_METRICS_PORT": "0"}  # a free port each (tracker: its HTTP API)
    summary = {}
    for k in args.k:
        pairs = []
        for i in range(args.metrics_pairs):
            measured = {}
            for label in (("off", "on") if i % 2 == 0 else ("on", "off")):
                durations = run(k, args.rounds, tmp, endpoint, args.storage, on if label == "on" else None)
                cpu_ms = sum(LAST_CPU.get(kind, 0.0) for kind in APIARY_KINDS)
                measured[label] = (cpu_ms / 1000, statistics.median(durations))
            (cpu_off, round_off), (cpu_on, round_on) = measured["off"], measured["on"]
            pairs.append((cpu_on / cpu_off, round_on / round_off))
            print(f"pair {i + 1} K={k}: Apiary CPU per round off {cpu_off * 1000:.1f} ms, on {cpu_on * 1000:.1f} ms"
                  f" ({cpu_on / cpu_off:.3f}); median round off {round_off * 1000:.1f} ms,"
                  f" on {round_on * 1000:.1f} ms ({round_on / round_off:.3f})", flush=True)
        cpu_ratio = statistics.median(c for c, _ in pairs)
        round_ratio = statistics.median(r for _, r in pairs)
        summary[k] = {"cpu_ratio_on_off": round(cpu_ratio, 3), "round_ratio_on_off": round(round_ratio, 3),
                      "pairs": len(pairs)}
        print(f"K={k}: metrics on/off, median of {len(pairs)} pairs: Apiary CPU per round {cpu_ratio:.3f},"
              f" round time {round_ratio:.3f}", flush=True)
    return summary


def main() -> None:
    global CPU
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--flower-python", help="a Python with flwr[simulation]: measure Flower's reference now")
    parser.add_argument("--storage", choices=["s3", "file"], default="s3",
                        help="s3: moto's S3 server (the benchmark); file: a shared local folder, to see what "
                             "the rest of the system costs without S3 requests")
    parser.add_argument("--against", metavar="REF", nargs="+",
                        help="commits whose code runs the same benchmark beside this one's, in groups")
    parser.add_argument("--pairs", type=int, default=3, help="with --against: groups of runs per K")
    parser.add_argument("--metrics-pairs", type=int, default=0,
                        help="pairs of runs per K with operational metrics off and on (APIARY_METRICS=prometheus)")
    add_json_argument(parser, "round")
    args = parser.parse_args()
    reference, source = dict(FLOWER), "the issue's figure"
    if args.flower_python:
        reference.update(measure_flower(args.flower_python, args.k, args.rounds))
        source = "measured just now"
        print("Flower 1.42 (simulation engine): " + ", ".join(
            f"K={k} {v * 1000:.1f} ms" for k, v in sorted(reference.items()) if k in args.k), flush=True)
    # What its job may reach (apiary.policy), passed on to every process: the toy entrypoint, the temporary data.
    os.environ.setdefault("APIARY_ALLOWED_ENTRYPOINTS", json.dumps(["tests.toyjobs.*"]))
    os.environ.setdefault("APIARY_DATA_ROOTS", json.dumps([tempfile.gettempdir()]))
    moto, endpoint = s3server.launch()
    MOTO.append(moto)
    results: dict[int, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="apiary-bench-") as tmp:
            if args.against:
                CPU = True
                summary = paired(args, endpoint, Path(tmp))
                print(json.dumps(summary))
                record("round", args.json, {"k": args.k, "rounds": args.rounds, "against": summary},
                       reference=f"the same benchmark of {', '.join(args.against)} run beside this code, in groups")
                return
            if args.metrics_pairs:
                CPU = True
                summary = metrics_cost(args, endpoint, Path(tmp))
                print(json.dumps(summary))
                record("round-metrics", args.json.replace("round.json", "round-metrics.json"), summary,
                       reference="the same rounds with operational metrics off, in pairs")
                return
            for k in args.k:
                durations = run(k, args.rounds, Path(tmp), endpoint, args.storage)
                median = statistics.median(durations)
                p90 = sorted(durations)[int(0.9 * len(durations))]
                results[k] = {"median_s": round(median, 4), "p90_s": round(p90, 4),
                              "min_s": round(min(durations), 4), "rounds": len(durations)}
                ref = reference.get(k)
                versus = (f", {median / ref:.2f}x Flower's {ref * 1000:.0f} ms ({source}; goal <= 0.25x)"
                          if ref else "")
                if ref:
                    results[k]["vs_flower"] = round(median / ref, 3)
                print(f"K={k} ({args.storage}): median round {median * 1000:.1f} ms over {len(durations)} rounds "
                      f"(min {min(durations) * 1000:.1f}, p90 {results[k]['p90_s'] * 1000:.1f}){versus}", flush=True)
                if args.storage == "s3":
                    floor, server_cpu = storage_floor(endpoint, k, args.rounds)
                    results[k]["s3_floor_s"] = round(floor, 4)
                    print(f"  the round's {3 * k + 1} S3 requests alone, no Apiary running: {floor * 1000:.1f} ms"
                          + (f" ({floor / ref:.2f}x Flower's)" if ref else "")
                          + f", S3 server CPU {server_cpu * 1000:.1f} ms per round", flush=True)
    finally:
        moto.terminate()
    print(json.dumps(results))
    record("round", args.json, {"storage": args.storage, "by_k": results},
           reference=f"Flower 1.42's simulation round ({source}); the round's S3 requests alone")


if __name__ == "__main__":
    main()
