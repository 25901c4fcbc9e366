"""What central differential privacy costs the digits example: held-out accuracy and ε after 5 and 20 rounds,
fixed clipping at noise multipliers 0.5, 1 and 2 next to the same job without privacy.

Each setting runs end to end through `apiary run` (its own APIARY_HOME under .apiary/privacy/), the example's
3-worker job file with 20 rounds and an evaluation after every round (its `fl_evaluate_model`, on a worker);
ε at δ 1e-5 is the one the aggregator reported with each round. `--clipping-norm` defaults to the median
update norm measured in the run without privacy (printed), so that about half the updates are clipped.
Writes docs/privacy-accuracy.md.

    python scripts/privacy_accuracy.py                     # the four settings, one after the other
    python scripts/privacy_accuracy.py --rounds 5          # a quicker look
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


def job_request(name: str, rounds: int, privacy: dict[str, Any] | None) -> dict[str, Any]:
    """The example's 3-worker job with absolute paths, `rounds` rounds evaluated each, and `privacy` if given."""
    request = yaml.safe_load((DIGITS / "job.yaml").read_text())
    request["name"] = name
    request["dataset"] = str(DIGITS / request["dataset"])
    request["config"] = {**request["config"], "heldout": str(DIGITS / request["config"]["heldout"]), "seed": 0}
    request["distributed"].update(num_rounds=rounds, min_workers=3, max_workers=3, evaluate_every=1)
    if privacy is not None:
        request["distributed"]["differential_privacy"] = privacy
    return request


def run(name: str, request: dict[str, Any]) -> dict[str, Any]:
    """One `apiary run` of the request: each round's accuracy and metrics, the run's wall time and its folder."""
    folder = WORK / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job_file = folder / "job.json"
    job_file.write_text(json.dumps(request, indent=1))
    env = {**os.environ, "APIARY_HOME": str(folder / "home"), "APIARY_HTTP_PORT": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "shared"), str(REPO)])}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "services.app.cli", "run", str(job_file), "--workers", "3",
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=max(REPORTED_ROUNDS))
    parser.add_argument("--clipping-norm", type=float, default=None)
    args = parser.parse_args(argv)

    outcomes: list[tuple[str, float | None, dict[str, Any]]] = []
    plain = run("no-dp", job_request("privacy-no-dp", args.rounds, None))
    outcomes.append(("no differential privacy", None, plain))
    norms = update_norms(plain["job_folder"], args.rounds)
    clipping_norm = args.clipping_norm or (round(statistics.median(norms), 3) if norms else 1.0)
    print(f"update norms without privacy: {len(norms)} measured, median {statistics.median(norms) if norms else 0:.3f}"
          f", min {min(norms, default=0):.3f}, max {max(norms, default=0):.3f}; clipping norm {clipping_norm}",
          file=sys.stderr)
    for z in NOISE_MULTIPLIERS:
        privacy = {"clipping": "fixed", "noise_multiplier": z, "clipping_norm": clipping_norm}
        outcomes.append((f"fixed clipping, z={z}", z, run(f"z{z}", job_request(f"privacy-z{z}", args.rounds,
                                                                                privacy))))
    lines = [f"| setting | accuracy after {' / '.join(map(str, REPORTED_ROUNDS))} rounds | "
             f"ε after {' / '.join(map(str, REPORTED_ROUNDS))} rounds (δ 1e-5) | wall time (s) |",
             "| --- | ---: | ---: | ---: |"]
    for name, _, outcome in outcomes:
        shown = [r for r in REPORTED_ROUNDS if r <= args.rounds]
        accuracy = " / ".join(f"{outcome['accuracy'].get(r, float('nan')):.3f}" for r in shown)
        epsilons = " / ".join(f"{outcome['rounds'].get(r, {}).get('dp_epsilon', float('inf')):.2f}" for r in shown)
        lines.append(f"| {name} | {accuracy} | {epsilons if _ else '∞ (no privacy)'} | {outcome['wall_s']:.0f} |")
    text = "\n".join(lines)
    print(text)
    (REPO / "docs" / "privacy-accuracy.md").write_text(
        "# Differential privacy on the digits example\n\n"
        f"Written by `python scripts/privacy_accuracy.py` (3 workers, {args.rounds} rounds, fixed clipping at norm "
        f"{clipping_norm}: the median update norm of the run without privacy, {len(norms)} updates measured; "
        "noise std `z * C / 3` per parameter, seeded from the OS).\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
