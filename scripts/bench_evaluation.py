#!/usr/bin/env python
"""Evaluation benchmark (issue 18): what evaluating every round on a worker costs a job's wall time.

Runs the digits example on the embedded stack (3 in-process workers) twice, alternately, in the same
process after a warm-up job: evaluated after every round (`evaluate_every: 1`) and only after the last
(`evaluate_every: 0`), and prints each job's wall time (request to completion) and their medians' ratio.
Evaluation runs as a task on a worker beside the next round's training, so the ratio says how much it
holds training up.

Usage: python scripts/bench_evaluation.py [--rounds 5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_record import add_json_argument, record  # noqa: E402


def digits_request(rounds: int, evaluate_every: int) -> dict[str, Any]:
    """The digits example's job file, with its paths resolved and the rounds and evaluation asked for."""
    from services.app.jobfile import load_job_file

    if not (REPO / "examples/digits/data/manifest.json").is_file():
        subprocess.run([sys.executable, "examples/digits/prepare.py"], cwd=REPO, check=True, capture_output=True)
    request = load_job_file(REPO / "examples/digits/job.yaml")
    request["dataset"] = str(REPO / "examples/digits/data")
    request["config"] = {**request["config"], "heldout": str(REPO / "examples/digits/heldout")}
    request["distributed"] = {**request["distributed"], "num_rounds": rounds, "evaluate_every": evaluate_every}
    return request


async def run_job(home: Path, request: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """One job on a fresh embedded stack: its wall time from request to completion, and its view."""
    from apiary.settings import Settings
    from services.app.runtime import Embedded

    settings = Settings(home=home, http_port=0)
    async with Embedded(settings, workers=3, code_paths=[str(REPO)]) as stack:
        started = time.monotonic()
        view = await stack.wait(await stack.submit(request), timeout=900)
        return time.monotonic() - started, view


async def main(rounds: int, repeats: int, json_path: str) -> None:
    """Alternate the two settings `repeats` times; print the medians and their ratio."""
    walls: dict[int, list[float]] = {1: [], 0: []}
    with tempfile.TemporaryDirectory(prefix="apiary-bench-eval-") as tmp:
        # One job first, not counted: the first one pays for cold caches (imports, dataset files).
        await run_job(Path(tmp) / "warm-up", digits_request(1, 0))
        for repeat in range(repeats):
            for every in (1, 0):
                wall, view = await run_job(Path(tmp) / f"{every}-{repeat}", digits_request(rounds, every))
                assert view["status"] == "completed", view.get("reason")
                evaluated = sum(1 for r in view["rounds"] if r.get("evaluation"))
                walls[every].append(wall)
                print(f"evaluate_every={every}: {wall:.1f} s, {evaluated} rounds evaluated, "
                      f"accuracy {view['metrics'].get('accuracy')}", flush=True)
    every_round, at_end = statistics.median(walls[1]), statistics.median(walls[0])
    print(f"digits, {rounds} rounds, 3 workers: evaluated every round {every_round:.1f} s, only at the end "
          f"{at_end:.1f} s; ratio {every_round / at_end:.2f}")
    record("evaluation", json_path, {
        "rounds": rounds, "repeats": repeats, "workers": 3,
        "wall_s": {"evaluate_every_round": [round(w, 1) for w in walls[1]], "only_at_end": [round(w, 1) for w in walls[0]]},
        "median_wall_s": {"evaluate_every_round": round(every_round, 1), "only_at_end": round(at_end, 1)},
        "ratio": round(every_round / at_end, 3),
    }, reference="the same digits job evaluated only at the end (evaluate_every 0), alternating with it")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    add_json_argument(parser, "evaluation")
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.repeats, args.json))
