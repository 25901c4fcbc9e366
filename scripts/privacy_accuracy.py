"""What central differential privacy costs the digits example: held-out accuracy and ε after 5 and 20 rounds,
fixed clipping at noise multipliers 0.5, 1 and 2 next to the same job without privacy.

Each setting runs end to end through `apiary run` (its own APIARY_HOME under .apiary/privacy/), on the example's
3-worker job file and on its 8-worker one, 20 rounds with an evaluation after every round (its
`fl_evaluate_model`, on a worker); ε at δ 1e-5 is the one the aggregator reported with each round. The clipping
norm is the median update norm measured in the same job's run without privacy (printed), so that about half the
updates are clipped. Writes docs/privacy-accuracy.md.

    python scripts/privacy_accuracy.py                     # 3 and 8 workers, four settings each, one at a time
    python scripts/privacy_accuracy.py --workers 3 --rounds 5   # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "shared")]
DIGITS = REPO / "examples" / "digits"
WORK = REPO / ".apiary" / "privacy"
NOISE_MULTIPLIERS = (0.5, 1.0, 2.0)
REPORTED_ROUNDS = (5, 20)


JOB_FILES = {3: "job.yaml", 8: "job-8workers.yaml"}  # the example's job file for each worker count


def job_request(name: str, workers: int, rounds: int, privacy: dict[str, Any] | None) -> dict[str, Any]:
    """The example's job for `workers` with absolute paths, `rounds` rounds evaluated each, and `privacy` if given
    (every worker takes part in every round: min_workers = max_workers)."""
    request = yaml.safe_load((DIGITS / JOB_FILES[workers]).read_text())
    request["name"] = name
    request["dataset"] = str(DIGITS / request["dataset"])
    request["config"] = {**request["config"], "heldout": str(DIGITS / request["config"]["heldout"]), "seed": 0}
    request["distributed"].update(num_rounds=rounds, min_workers=workers, max_workers=workers, evaluate_every=1)
    if privacy is not None:
        request["distributed"]["differential_privacy"] = privacy
    return request


def run(name: str, request: dict[str, Any], workers: int) -> dict[str, Any]:
    """One `apiary run` of the request: each round's accuracy and metrics, the run's wall time and its folder."""
    folder = WORK / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job_file = folder / "job.json"
    job_file.write_text(json.dumps(request, indent=1))
    env = {**os.environ, "APIARY_HOME": str(folder / "home"), "APIARY_HTTP_PORT": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "shared"), str(REPO)])}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "services.app.cli", "run", str(job_file), "--workers", str(workers),
                           "--json", "--gpus", "none"], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{name}: apiary run exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    summary = json.loads(done.stdout)
    job_folder = folder / "home" / "storage" / "jobs" / summary["job_id"]
    report = json.loads((job_folder / "final" / "metrics.json").read_text())
    accuracy = {e["round"]: float(e["metrics"]["accuracy"]) for e in report["evaluations"] if e["status"] == "done"}
    rounds = {r["round"]: r.get("metrics") or {} for r in report.get("rounds", [])}
    return {"summary": summary, "accuracy": accuracy, "rounds": rounds, "wall_s": wall, "job_folder": job_folder}


def update_norms(job_folder: Path, rounds: int) -> list[float]:
    """Every contribution's update norm (its weights less the round's starting global weights)."""
    from safetensors.torch import load_file

    from apiary.strategies.clipping import update_norm

    norms = []
    for r in range(1, rounds + 1):
        start_file = job_folder / "rounds" / f"{r - 1:04d}" / "global.safetensors"
        if not start_file.is_file():
            start_file = job_folder / "initial.safetensors"
        if not start_file.is_file():
            continue
        start = load_file(start_file)
        for contribution in sorted((job_folder / "rounds" / f"{r:04d}").glob("**/*.safetensors")):
            if contribution.name != "global.safetensors":
                norms.append(update_norm(load_file(contribution), start))
    return norms


def measure(workers: int, rounds: int) -> tuple[str, str]:
    """The four settings on `workers` workers: the markdown table, and how the clipping norm was chosen."""
    outcomes: list[tuple[str, float | None, dict[str, Any]]] = []
    plain = run(f"{workers}w-no-dp", job_request(f"privacy-{workers}w-no-dp", workers, rounds, None), workers)
    outcomes.append(("no differential privacy", None, plain))
    norms = update_norms(plain["job_folder"], rounds)
    clipping_norm = round(statistics.median(norms), 3) if norms else 1.0
    how = (f"{workers} workers ({JOB_FILES[workers]}), clipping norm {clipping_norm}: the median of the run without "
           f"privacy's {len(norms)} update norms (min {min(norms, default=0):.3f}, max {max(norms, default=0):.3f}); "
           f"noise std per parameter `z * {clipping_norm} / {workers}`")
    print(how, file=sys.stderr)
    for z in NOISE_MULTIPLIERS:
        privacy = {"clipping": "fixed", "noise_multiplier": z, "clipping_norm": clipping_norm}
        outcomes.append((f"fixed clipping, z={z}", z, run(f"{workers}w-z{z}", job_request(
            f"privacy-{workers}w-z{z}", workers, rounds, privacy), workers)))
    shown = [r for r in REPORTED_ROUNDS if r <= rounds]
    lines = [f"| {workers} workers | accuracy after {' / '.join(map(str, shown))} rounds | "
             f"ε after {' / '.join(map(str, shown))} rounds (δ 1e-5) | wall time (s) |",
             "| --- | ---: | ---: | ---: |"]
    for name, z, outcome in outcomes:
        accuracy = " / ".join(f"{outcome['accuracy'].get(r, float('nan')):.3f}" for r in shown)
        epsilons = " / ".join(f"{outcome['rounds'].get(r, {}).get('dp_epsilon', float('inf')):.2f}" for r in shown)
        lines.append(f"| {name} | {accuracy} | {epsilons if z else '∞ (no privacy)'} | {outcome['wall_s']:.0f} |")
    return "\n".join(lines), how


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=max(REPORTED_ROUNDS))
    parser.add_argument("--workers", type=int, choices=sorted(JOB_FILES), action="append")
    args = parser.parse_args(argv)

    parts = []
    for workers in args.workers or sorted(JOB_FILES):
        table, how = measure(workers, args.rounds)
        print(table)
        parts.append(f"{how}.\n\n{table}\n")
    (REPO / "docs" / "privacy-accuracy.md").write_text(
        "# Differential privacy on the digits example\n\n"
        f"Written by `python scripts/privacy_accuracy.py`: {args.rounds} rounds, every worker in every round, "
        "fixed clipping, noise seeded from the OS, ε as the aggregator reported it.\n\n" + "\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
