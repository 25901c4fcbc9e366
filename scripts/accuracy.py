"""How close federated training of the digits example comes to central training, on IID and skewed shards.

Runs each setting end to end through `apiary run` (one process tree per setting, its own APIARY_HOME under
.apiary/accuracy/). Each round's held-out accuracy is the run's own evaluation of that round (the example's
`fl_evaluate_model` on a worker, listed in the run's final/metrics.json), checked against the same function
run here on the round's stored global weights. Writes docs/benchmarks/accuracy.md (held-out accuracy, rounds to reach
95% of the central accuracy, wall and CPU time), docs/benchmarks/accuracy.png (accuracy per round, one line per setting)
and docs/benchmarks/accuracy.json (each setting's accuracy per round, for --against).

Where a run's time goes: starting processes that import torch (the `apiary run` process and each worker's
training child: ~2 s of CPU each), not the rounds (a digits round takes ~0.3 s). An 8-worker run costs ~30 s of
CPU, a 3-worker one ~13 s; more runs at a time than cores only makes them share the CPU (4 at a time, with
up to 36 such processes starting together, took 27 minutes here), so 2 run at a time, the costliest first,
and every process of a run has one intra-op thread (OMP_NUM_THREADS=1: the training already does, and the
rest has tiny tensors).

    python scripts/accuracy.py                                   # every setting, 2 runs at a time
    python scripts/accuracy.py --only 3w                         # settings whose name contains '3w'
    python scripts/accuracy.py --against docs/benchmarks/accuracy.json  # also: how far each setting moved since then
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the example's own evaluation: examples.digits.train
DIGITS = REPO / "examples" / "digits"
WORK = REPO / ".apiary" / "accuracy"
SEED = 0
REACH = 0.95  # "rounds to reach" counts rounds until accuracy is at least this share of the central one

# The strategy settings docs/how-to/skewed-data.md recommends for skewed shards.
RECOMMENDED: dict[str, dict[str, Any]] = {
    "fedavgm": {"server_learning_rate": 1.0, "server_momentum": 0.5},
    "fedprox": {"proximal_mu": 0.1},
    "fedadam": {"eta": 0.2, "tau": 0.01, "beta_1": 0.5},
}


@dataclass(frozen=True)
class Setting:
    """One run: the job file it starts from, its workers, its split and its strategy."""

    name: str
    job_file: str
    workers: int
    split: str = "iid"  # iid, or the Dirichlet alpha of a label_skew split
    strategy: str = "federated_averaging"

    @property
    def central(self) -> bool:
        """Whether this is the central reference: one worker on the whole dataset."""
        return self.workers == 1


@dataclass
class Outcome:
    """What a run gave: held-out accuracy after each round, the run's own final metrics, its wall time."""

    setting: Setting
    accuracy: list[float] = field(default_factory=list)
    final_metrics: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # user + system time of the run's whole process tree
    load: tuple[float, float] = (0.0, 0.0)  # the machine's 1-minute load average when it started and ended
    error: str | None = None


def settings() -> list[Setting]:
    """Central against FedAvg at 3 and 8 workers, IID and label skew 0.5 and 0.1; the recommended strategies
    on the skewed cases. Each worker count runs its own shipped job file (rounds, epochs, learning rate)."""
    out = []
    for workers, job_file in ((3, "job.yaml"), (8, "job-8workers.yaml")):
        tag = f"{workers}w"
        out.append(Setting(f"central ({tag} epochs)", job_file, 1))
        for split in ("iid", "0.5", "0.1"):
            out.append(Setting(f"{tag} {_split_name(split)} fedavg", job_file, workers, split))
        for split in ("0.5", "0.1"):
            for strategy in RECOMMENDED:
                out.append(Setting(f"{tag} {_split_name(split)} {strategy}", job_file, workers, split, strategy))
    return out


def _split_name(split: str) -> str:
    return "IID" if split == "iid" else f"alpha={split}"


def job_request(setting: Setting) -> dict[str, Any]:
    """The setting's job request: its job file, with absolute paths, its split, strategy and sizes."""
    request = yaml.safe_load((DIGITS / setting.job_file).read_text())
    request["name"] = f"accuracy-{setting.name}".replace(" ", "-").replace("(", "").replace(")", "")
    request["dataset"] = str(DIGITS / request["dataset"])
    request["config"] = {**request["config"], "heldout": str(DIGITS / request["config"]["heldout"]), "seed": SEED}
    distributed = {**request["distributed"], "strategy": setting.strategy,
                   "strategy_params": RECOMMENDED.get(setting.strategy, {})}
    distributed.update(max_workers=setting.workers, min_workers=setting.workers, evaluate_every=1)
    if setting.strategy == "federated_averaging":
        distributed.pop("strategy_params")
    request["distributed"] = distributed
    request["split"] = ({"strategy": "random", "seed": SEED} if setting.split == "iid"
                        else {"strategy": "label_skew", "alpha": float(setting.split), "seed": SEED})
    return request


def run(setting: Setting) -> Outcome:
    """Run one setting through `apiary run` and evaluate each round's global weights."""
    folder = WORK / setting.name.replace(" ", "_").replace("(", "").replace(")", "")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job_file = folder / "job.json"
    job_file.write_text(json.dumps(job_request(setting), indent=1))
    # One intra-op thread per process: the example trains with one already, and the run's processes share
    # the machine's cores with one another (and with the other run going on at the same time).
    env = {**os.environ, "APIARY_HOME": str(folder / "home"), "APIARY_HTTP_PORT": "0", "OMP_NUM_THREADS": "1"}
    command = [str(Path(sys.executable).with_name("apiary")), "run", str(job_file), "--workers", str(setting.workers),
               "--json", "--gpus", "none"]
    load = os.getloadavg()[0]
    started = time.monotonic()
    with open(folder / "stdout.json", "w") as stdout, open(folder / "stderr.log", "w") as stderr:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
        # wait4, not wait: the CPU time of the run's process tree (its workers' training children included).
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    outcome = Outcome(setting, wall_s=time.monotonic() - started, cpu_s=usage.ru_utime + usage.ru_stime,
                      load=(load, os.getloadavg()[0]))
    try:
        summary = json.loads((folder / "stdout.json").read_text())
    except json.JSONDecodeError:
        last = (folder / "stderr.log").read_text().strip().splitlines()[-1:]
        outcome.error = f"apiary run exited {process.returncode}: {last}"
        return outcome
    if summary["status"] != "completed":
        outcome.error = f"{summary['status']}: {summary.get('reason')}"
        return outcome
    outcome.final_metrics = summary["metrics"]
    job_folder = folder / "home" / "storage" / "jobs" / summary["job_id"]
    outcome.accuracy = evaluated_accuracies(job_folder / "final" / "metrics.json")
    here = round_accuracies(job_folder, summary["rounds_completed"], job_request(setting)["config"]["heldout"])
    if here != outcome.accuracy:
        outcome.error = f"the run's evaluations {outcome.accuracy} differ from this script's {here}"
    return outcome


def evaluated_accuracies(report: Path) -> list[float]:
    """Each round's accuracy as the run's workers evaluated it (its final/metrics.json), in round order."""
    evaluations = json.loads(report.read_text())["evaluations"]
    return [float(e["metrics"]["accuracy"]) for e in sorted(evaluations, key=lambda e: e["round"])
            if e["status"] == "done"]


def round_accuracies(job_folder: Path, rounds: int, heldout: str) -> list[float]:
    """Held-out accuracy of each round's stored global weights, by the example's own fl_evaluate_model."""
    from safetensors.torch import load_file

    from examples.digits.train import fl_evaluate_model

    return [float(fl_evaluate_model(load_file(job_folder / "rounds" / f"{r:04d}" / "global.safetensors"),
                                    {"HELDOUT": heldout})["accuracy"]) for r in range(1, rounds + 1)]


def rounds_to_reach(accuracy: list[float], target: float) -> int | None:
    """The first round whose accuracy is at least `target`, or None if none is."""
    return next((i + 1 for i, value in enumerate(accuracy) if value >= target), None)


def central_of(outcomes: list[Outcome], setting: Setting) -> Outcome | None:
    """The central reference run of a setting's job file."""
    return next((o for o in outcomes if o.setting.central and o.setting.job_file == setting.job_file), None)


def table(outcomes: list[Outcome]) -> list[str]:
    """docs/benchmarks/accuracy.md's table: one row per setting."""
    rows = ["| setting | workers | split | strategy | held-out accuracy | gap to central (pt) |"
            f" rounds to {REACH:.0%} of central | wall time (s) | CPU time (s) |",
            "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for o in outcomes:
        central = central_of(outcomes, o.setting)
        if o.error or not o.accuracy:
            rows.append(f"| {o.setting.name} | {o.setting.workers} | | | failed: {o.error} | | | | |")
            continue
        final = o.accuracy[-1]
        gap = "" if central is None or o.setting.central or not central.accuracy else \
            f"{100 * (final - central.accuracy[-1]):+.1f}"
        reach = None if central is None or not central.accuracy else \
            rounds_to_reach(o.accuracy, REACH * central.accuracy[-1])
        rows.append(f"| {o.setting.name} | {o.setting.workers} | {_split_name(o.setting.split)} | "
                    f"{o.setting.strategy} | {final:.3f} | {gap} | {reach if reach else 'not reached'} | "
                    f"{o.wall_s:.0f} | {o.cpu_s:.0f} |")
    return rows


def differences(outcomes: list[Outcome], against: dict[str, list[float]]) -> dict[str, float]:
    """Each setting's largest difference (points) from an earlier run's accuracy, over its rounds."""
    out = {}
    for o in outcomes:
        before = against.get(o.setting.name)
        if before is not None and o.accuracy and len(before) == len(o.accuracy):
            out[o.setting.name] = max(100 * abs(a - b) for a, b in zip(o.accuracy, before, strict=True))
    return out


def write_markdown(outcomes: list[Outcome], path: Path, total_s: float, parallel: int,
                   moved: dict[str, float] | None = None, against: str = "") -> None:
    """The results page: how it was measured, the table, the plot."""
    jobs = {name: yaml.safe_load((DIGITS / name).read_text()) for name in ("job.yaml", "job-8workers.yaml")}
    sizes = "; ".join(f"`examples/digits/{name}`: {j['distributed']['num_rounds']} rounds x "
                      f"{j['config']['epochs']} epoch(s), learning rate {j['config']['learning_rate']}"
                      for name, j in jobs.items())
    loads = [value for o in outcomes for value in o.load]
    cpu = sum(o.cpu_s for o in outcomes)
    lines = [
        "# Accuracy: federated against central training (digits example)",
        "",
        "Written by `python scripts/accuracy.py`: every setting runs end to end through `apiary run` (the",
        "embedded deployment, CPU workers), seed 0. Held-out accuracy is on the 360 held-out images (one image",
        "is 0.28 points): each round's evaluation by the example's own `fl_evaluate_model` on a worker",
        "(`evaluate_every: 1`), checked against the same function run by the script on the round's stored global",
        "weights; the last round's figure is the table's. Central is one worker on the whole training",
        f"set for the same rounds and epochs as the federated runs it is compared with ({sizes}). Skewed",
        "shards are `split: {strategy: label_skew, alpha: A}` (Dirichlet over the shards, per label); the",
        "strategies' parameters are those the skewed-data guide recommends: "
        + ", ".join(f"{k} {v}" for k, v in RECOMMENDED.items()) + ".",
        f"Wall time is each run's `apiary run` from start to exit, {parallel} runs at a time on this 2-core machine,",
        "which other sessions' work (tests, benchmarks) shared meanwhile: its load average was "
        f"{min(loads, default=0):.0f} to {max(loads, default=0):.0f} at the runs' starts and ends. The whole script "
        f"took {total_s / 60:.1f} minutes. CPU time is the run's",
        f"whole process tree (user + system; {cpu / 60:.1f} minutes for all runs), which the load does not inflate",
        "as much: most of it is starting processes that import torch, not the rounds.",
        "",
    ]
    if moved:
        worst = max(moved, key=lambda name: moved[name])
        same = sum(1 for v in moved.values() if v == 0)
        lines += [f"Reproducibility: against an earlier run of the script (`--against {against}`), the largest",
                  f"difference in any setting's accuracy in any round was {moved[worst]:.2f} points"
                  + (f" ({worst})" if moved[worst] else "")
                  + f"; {same} of {len(moved)} settings were identical in every round.", ""]
    lines += [*table(outcomes), "", "![held-out accuracy per round](accuracy.png)", ""]
    lines += ["On an unequal fleet (one worker 5x slower), the time to 95% held-out accuracy of asynchronous "
              "aggregation (FedBuff, `mode: async`) against these synchronous rounds is measured by "
              "`scripts/bench_async.py`: [asynchronous aggregation](async.md).", ""]
    path.write_text("\n".join(lines))


def write_plot(outcomes: list[Outcome], path: Path) -> None:
    """Accuracy per round, one line per setting: a panel per worker count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    files = sorted({o.setting.job_file for o in outcomes}, key=lambda f: f != "job.yaml")
    figure, axes = plt.subplots(1, len(files), figsize=(7 * len(files), 5), squeeze=False)
    colours = {"iid": "#2f6fde", "0.5": "#e5731a", "0.1": "#c23b8a"}
    dashes = {"federated_averaging": "-", "fedavgm": "--", "fedprox": ":", "fedadam": "-."}
    for ax, job_file in zip(axes[0], files, strict=True):
        for o in outcomes:
            if o.setting.job_file != job_file or not o.accuracy:
                continue
            rounds = range(1, len(o.accuracy) + 1)
            style = {"color": "black", "linewidth": 2.5} if o.setting.central else {
                "color": colours[o.setting.split], "linestyle": dashes[o.setting.strategy]}
            ax.plot(rounds, o.accuracy, marker="o", markersize=3, label=o.setting.name, **style)
        ax.set_title(f"examples/digits/{job_file}")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Run the settings, print each result, write the page, the plot and the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run only the settings whose name contains this")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks",
                        help="where accuracy.md, .png and .json go")
    parser.add_argument("--against", type=Path, help="an earlier accuracy.json: how far each setting moved since")
    args = parser.parse_args(argv)
    against = json.loads(args.against.read_text()) if args.against else {}
    if not (DIGITS / "data" / "manifest.json").is_file():
        subprocess.run([sys.executable, str(DIGITS / "prepare.py")], check=True)
    chosen = [s for s in settings() if args.only in s.name]
    started = time.monotonic()
    done: dict[Setting, Outcome] = {}
    with ThreadPoolExecutor(args.parallel) as pool:
        # The costliest runs first (most workers), so that the last ones to finish are short.
        futures = [pool.submit(run, s) for s in sorted(chosen, key=lambda s: -s.workers)]
        for future in as_completed(futures):
            outcome = future.result()
            print(f"{outcome.setting.name:28s} {outcome.error or ' '.join(f'{a:.3f}' for a in outcome.accuracy)}"
                  f"  ({outcome.wall_s:.0f}s, {outcome.cpu_s:.0f}s CPU; run's own final accuracy "
                  f"{outcome.final_metrics.get('accuracy')})", flush=True)
            done[outcome.setting] = outcome
    outcomes = [done[s] for s in chosen]
    total = time.monotonic() - started
    moved = differences(outcomes, against)
    args.out.mkdir(parents=True, exist_ok=True)
    write_markdown(outcomes, args.out / "accuracy.md", total, args.parallel, moved, str(args.against or ""))
    write_plot(outcomes, args.out / "accuracy.png")
    (args.out / "accuracy.json").write_text(json.dumps({o.setting.name: o.accuracy for o in outcomes}, indent=1) + "\n")
    print(f"wrote {args.out / 'accuracy.md'}, .png and .json in {total / 60:.1f} min")
    if moved:
        print("largest difference from " + str(args.against) + ": " + ", ".join(
            f"{name} {value:.2f} pt" for name, value in sorted(moved.items(), key=lambda kv: -kv[1])[:5]))
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
