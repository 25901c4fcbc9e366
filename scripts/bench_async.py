"""Asynchronous buffered aggregation (FedBuff, `distributed.mode: async`) against synchronous FedAvg on an unequal
fleet: wall-clock time until the digits example's global model reaches 95% held-out accuracy.

Four workers train the digits example (examples/digits/paced.py: each task takes at least --pace seconds, a
stand-in for a real model's step time, and shard 3's takes --factor times as long: one worker 5x slower). Both
modes get the same budget of updates: sync runs --rounds rounds of 4 updates, async --rounds * 4 / --buffer
versions of --buffer updates (polynomial staleness weight (1+s)^-a, a = --staleness-exponent, default 0.5; server
learning rate --server-lr, default 1; version_wait --version-wait, default 0.5). Each run goes
through `apiary run` (embedded: in-memory bus, SQLite, local folder) with its own APIARY_HOME; afterwards each
round's (version's) stored global weights are scored on the held-out set by the example's fl_evaluate_model, and
the time to target is from round 1's start to the close of the first round (version) at or above --target.
Rows: one slow worker on IID shards; no slow worker (async must not lose); one slow worker on label-skewed
shards (Dirichlet alpha 0.5). Each cell is the median of --runs runs; runs go one at a time (timings).

    python scripts/bench_async.py                       # every row, 3 runs each: 8-15 minutes on 2 cores
    python scripts/bench_async.py --runs 1 --only slow  # rows whose name contains 'slow'
Writes docs/benchmarks/async.md and docs/benchmarks/async.json (with --write).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DIGITS = REPO / "examples" / "digits"
WORK = REPO / ".apiary" / "bench-async"
WORKERS = 4
SLOW_SHARD = 3


@dataclass(frozen=True)
class Row:
    """One comparison: the fleet (a slow shard or none) and the split."""

    name: str
    slow: bool
    split: str  # iid, or the Dirichlet alpha of a label_skew split


ROWS = [Row("one 5x slower worker, IID", True, "iid"), Row("no slow worker, IID", False, "iid"),
        Row("one 5x slower worker, label skew alpha 0.5", True, "0.5")]


@dataclass
class Run:
    """One run: accuracy and close time of each round (version), and the time to target."""

    mode: str
    accuracy: list[float] = field(default_factory=list)
    closed_s: list[float] = field(default_factory=list)  # since round 1 started
    to_target_s: float | None = None
    warm_s: float = 0.0  # when every worker had reported its first task (its training process was up)
    wall_s: float = 0.0
    error: str | None = None


def request(row: Row, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """The run's job request: the digits job file, paced, in `mode`, with the same budget of updates."""
    job = yaml.safe_load((DIGITS / "job.yaml").read_text())
    job["name"] = f"bench-async-{mode}"
    job["entrypoint"] = "examples.digits.paced:fl_train_model"
    job["dataset"] = str(DIGITS / job["dataset"])
    job["config"] = {**job["config"], "heldout": str(DIGITS / job["config"]["heldout"]), "seed": 0,
                     "pace_seconds": args.pace, "slow_factor": args.factor,
                     "slow_shards": [SLOW_SHARD] if row.slow else []}
    distributed: dict[str, Any] = {**job["distributed"], "min_workers": WORKERS, "max_workers": WORKERS,
                                   "evaluate_every": 0, "num_rounds": args.rounds}
    if mode == "async":
        distributed.update(mode="async", num_rounds=args.rounds * WORKERS // args.buffer,
                           **{"async": {"buffer_size": args.buffer, "staleness_weight": "polynomial",
                                        "staleness_exponent": args.staleness_exponent,
                                        "server_learning_rate": args.server_lr,
                                        "version_wait": args.version_wait}})
    job["distributed"] = distributed
    job["split"] = ({"strategy": "random", "seed": 0} if row.split == "iid"
                    else {"strategy": "label_skew", "alpha": float(row.split), "seed": 0})
    return job


def run(row: Row, mode: str, index: int, args: argparse.Namespace) -> Run:
    """One run through `apiary run`, then each round's global weights scored on the held-out set."""
    folder = WORK / f"{row.split}-{'slow' if row.slow else 'even'}-{mode}-{index}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job_file = folder / "job.json"
    job_file.write_text(json.dumps(request(row, mode, args), indent=1))
    env = {**os.environ, "APIARY_HOME": str(folder / "home"), "APIARY_HTTP_PORT": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO / 'shared'}:{REPO}"}  # this checkout's code, whichever one the venv installed
    command = [str(Path(sys.executable).with_name("apiary")), "run", str(job_file), "--workers", str(WORKERS),
               "--json", "--gpus", "none"]
    started = time.monotonic()
    with open(folder / "stdout.json", "w") as stdout, open(folder / "stderr.log", "w") as stderr:
        code = subprocess.call(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
    out = Run(mode, wall_s=time.monotonic() - started)
    try:
        summary = json.loads((folder / "stdout.json").read_text())
    except json.JSONDecodeError:
        out.error = f"apiary run exited {code}: {(folder / 'stderr.log').read_text().strip().splitlines()[-1:]}"
        return out
    if summary["status"] != "completed":
        out.error = f"{summary['status']}: {summary.get('reason')}"
        return out
    job_id = summary["job_id"]
    with sqlite3.connect(folder / "home" / "apiary.db") as db:
        start = db.execute("SELECT MIN(started_at) FROM rounds WHERE job_id = ?", (job_id,)).fetchone()[0]
        closed = db.execute("SELECT round, closed_at FROM aggregations WHERE job_id = ? AND status = 'aggregated'"
                            " ORDER BY round", (job_id,)).fetchall()
        firsts = db.execute("SELECT MIN(received_at) FROM contributions WHERE job_id = ? GROUP BY worker_id",
                            (job_id,)).fetchall()
    out.warm_s = max(float(t) for (t,) in firsts) - float(start)
    from safetensors.torch import load_file

    from examples.digits.train import fl_evaluate_model

    heldout = str(DIGITS / "heldout")
    rounds = folder / "home" / "storage" / "jobs" / job_id / "rounds"
    for round_index, closed_at in closed:
        weights = load_file(rounds / f"{round_index:04d}" / "global.safetensors")
        out.accuracy.append(float(fl_evaluate_model(weights, {"HELDOUT": heldout})["accuracy"]))
        out.closed_s.append(float(closed_at) - float(start))
    out.to_target_s = next((t for a, t in zip(out.accuracy, out.closed_s, strict=True) if a >= args.target), None)
    return out


def after_warm_up(r: Run) -> float | None:
    """Time to target from the moment every worker had reported once (each one's training process up)."""
    return None if r.to_target_s is None else max(0.0, r.to_target_s - r.warm_s)


def median(values: list[float | None]) -> float | None:
    """The median of the runs that reached the target (None if fewer than half did)."""
    reached = [v for v in values if v is not None]
    return statistics.median(reached) if len(reached) * 2 > len(values) else None


def page(results: dict[str, dict[str, list[Run]]], args: argparse.Namespace) -> str:
    """docs/benchmarks/async.md."""
    warm = statistics.median([r.warm_s for modes in results.values() for runs in modes.values() for r in runs
                              if r.warm_s] or [0.0])
    lines = [
        "# Asynchronous buffered aggregation (FedBuff) against synchronous FedAvg",
        "",
        f"Measured by `python scripts/bench_async.py --runs {args.runs} --write` (its docstring says how; every run's "
        "figures are in [async.json](async.json)): the digits",
        f"example on {WORKERS} workers (embedded `apiary run`, 2 shared CPU cores), each training task paced to at "
        f"least {args.pace:g} s, shard {SLOW_SHARD}'s {args.factor:g}x that where a worker is slow. Same budget of "
        f"updates: sync {args.rounds} rounds x {WORKERS}, async {args.rounds * WORKERS // args.buffer} versions "
        f"x K={args.buffer} (polynomial staleness weight (1+s)^-{args.staleness_exponent:g}, server learning rate "
        f"{args.server_lr:g}, version_wait {args.version_wait:g}). Time to {args.target:.0%} held-out "
        f"accuracy from round 1's start, and after warm-up: from the moment every worker had reported its first task "
        f"(its training process started: {warm:.1f} s here, median of every run, including the slow worker's first "
        f"task where there is one). Median of {args.runs} runs each, in the "
        "same session, one run at a time, sync and async alternating.",
        "",
        f"| fleet and split | sync FedAvg: s to {args.target:.0%} | async FedBuff: s to {args.target:.0%} | "
        "speed-up | after warm-up: sync / async (s) | speed-up after warm-up | final accuracy sync / async | "
        "runs reaching the target sync / async |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, modes in results.items():
        sync, asyn = (median([r.to_target_s for r in modes[m]]) for m in ("sync", "async"))
        ratio = f"{sync / asyn:.2f}x" if sync and asyn else "n/a"
        warm_sync, warm_async = (median([after_warm_up(r) for r in modes[m]]) for m in ("sync", "async"))
        warm_ratio = ("n/a" if warm_sync is None or warm_async is None
                      else "async before warm-up" if warm_async == 0 else f"{warm_sync / warm_async:.2f}x")
        finals = " / ".join(f"{statistics.median([r.accuracy[-1] for r in modes[m] if r.accuracy] or [0]):.3f}"
                            for m in ("sync", "async"))
        reached = " / ".join(f"{sum(r.to_target_s is not None for r in modes[m])}/{len(modes[m])}"
                             for m in ("sync", "async"))
        show = (lambda v: f"{v:.1f}" if v is not None else "not reached")  # noqa: E731
        lines.append(f"| {name} | {show(sync)} | {show(asyn)} | {ratio} | {show(warm_sync)} / {show(warm_async)} | "
                     f"{warm_ratio} | {finals} | {reached} |")
    errors = [f"- {name} {r.mode}: {r.error}" for name, modes in results.items() for runs in modes.values()
              for r in runs if r.error]
    if errors:
        lines += ["", "Runs that failed:", *errors]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8, help="sync rounds (async: the same number of updates)")
    parser.add_argument("--buffer", type=int, default=2, help="async buffer size K")
    parser.add_argument("--staleness-exponent", type=float, default=0.5,
                        help="async: the exponent a of the polynomial staleness weight (1+s)^-a")
    parser.add_argument("--server-lr", type=float, default=1.0, help="async: FedBuff's server learning rate")
    parser.add_argument("--version-wait", type=float, default=0.5,
                        help="async: how long a worker may wait for a due version, as a fraction of its task's time "
                             "(0: FedBuff's next task at once)")
    parser.add_argument("--pace", type=float, default=1.0, help="seconds a training task takes at least")
    parser.add_argument("--factor", type=float, default=5.0, help="how much slower the slow worker is")
    parser.add_argument("--target", type=float, default=0.95, help="held-out accuracy to reach")
    parser.add_argument("--only", default="", help="rows whose name contains this")
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks/async.md and async.json")
    parser.add_argument("--page-from", default="", help="write the page from this async.json instead of running")
    args = parser.parse_args()
    results: dict[str, dict[str, list[Run]]] = {}
    for row in (r for r in ROWS if args.only in r.name and not args.page_from):
        results[row.name] = {"sync": [], "async": []}
        for index in range(args.runs):
            for mode in ("sync", "async"):  # alternating, so a change of load over time hits both alike
                outcome = run(row, mode, index, args)
                results[row.name][mode].append(outcome)
                print(f"{row.name} {mode} #{index}: to target {outcome.to_target_s} s (warm at {outcome.warm_s:.1f} s),"
                      f" wall {outcome.wall_s:.1f} s,"
                      f" accuracy {[round(a, 3) for a in outcome.accuracy]} {outcome.error or ''}", flush=True)
    if args.page_from:  # the page again from a run's stored figures (async.json), with these arguments
        stored = json.loads(Path(args.page_from).read_text())
        results = {name: {m: [Run(**r) for r in runs] for m, runs in modes.items()} for name, modes in stored.items()}
    text = page(results, args)
    print(text)
    if args.write:
        (REPO / "docs" / "benchmarks" / "async.md").write_text(text)
        (REPO / "docs" / "benchmarks" / "async.json").write_text(json.dumps(
            {name: {m: [asdict(r) for r in runs] for m, runs in modes.items()} for name, modes in results.items()},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
