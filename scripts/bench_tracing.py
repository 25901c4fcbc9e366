#!/usr/bin/env python
"""What tracing costs: the same job on the embedded stack, with tracing off and with every span
recorded (in-memory exporter, so the figure is the instrumentation's cost, not a network's).

Usage: python scripts/bench_tracing.py [--rounds 30] [--workers 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from apiary import telemetry  # noqa: E402
from apiary.settings import Settings  # noqa: E402
from services.app.runtime import Embedded  # noqa: E402
from tests.toyjobs.toy import make_dataset  # noqa: E402

from bench_record import add_json_argument, record  # noqa: E402


async def one_job(tmp: Path, rounds: int, workers: int) -> list[float]:
    settings = Settings(home=tmp / ".apiary", heartbeat_interval=5, progress_interval=0)
    dataset = make_dataset(tmp / "data", workers * 4)
    async with Embedded(settings, workers=workers, code_paths=[str(REPO)]) as stack:
        job_id = await stack.submit({
            "name": "bench-tracing", "entrypoint": "tests.toyjobs.identity:fl_train_model", "dataset": str(dataset),
            "config": {"params": 100_000},
            "distributed": {"num_rounds": rounds, "min_workers": workers, "max_workers": workers},
        })
        view = await stack.wait(job_id, timeout=600)
        if view["status"] != "completed":
            raise RuntimeError(view.get("reason"))
        starts = [r["started_at"] for r in await stack.ports.db.fetch(
            "SELECT started_at FROM rounds WHERE job_id = $1 ORDER BY round", job_id)]
    return [b - a for a, b in itertools.pairwise(starts[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    add_json_argument(parser, "tracing")
    args = parser.parse_args()
    # The toy entrypoint and its dataset in a temporary folder: allowed here as the test suite allows them.
    os.environ.setdefault("APIARY_ALLOWED_ENTRYPOINTS", json.dumps(["tests.toyjobs.*"]))
    os.environ.setdefault("APIARY_DATA_ROOTS", json.dumps([tempfile.gettempdir()]))
    spans = 0
    results: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.repeat):
        for mode in ("off", "on"):
            exporter = InMemorySpanExporter()
            if mode == "on":
                telemetry.setup("apiary-bench", exporter=exporter)
            with tempfile.TemporaryDirectory() as tmp:
                durations = asyncio.run(one_job(Path(tmp), args.rounds, args.workers))
            results[mode].append(statistics.median(durations))
            if mode == "on":
                spans += len(exporter.get_finished_spans())
                telemetry.shutdown()
    off, on = min(results["off"]), min(results["on"])
    print(f"median round, tracing off: {off * 1000:.1f} ms; on: {on * 1000:.1f} ms; "
          f"difference {(on - off) * 1000:+.1f} ms ({(on / off - 1):+.1%}); "
          f"{spans} spans recorded in {args.repeat} traced jobs")
    record("tracing", args.json, {
        "rounds": args.rounds, "workers": args.workers, "repeat": args.repeat,
        "median_round_ms": {"off": round(off * 1000, 1), "on": round(on * 1000, 1)},
        "difference_ms": round((on - off) * 1000, 1), "ratio_on_off": round(on / off, 3),
        "spans_per_traced_job": spans // args.repeat,
    }, reference="the same embedded job with tracing off, alternating with tracing on (best of each)")


if __name__ == "__main__":
    main()
