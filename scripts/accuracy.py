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
    personal: tuple[str, ...] = ()  # distributed.personal_layers (FedPer)
    family: str = "shipped"  # shard-state: the settings of issue 41's section (SCAFFOLD, personal layers)

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
    # Each shard's model (the final model with its personal layers, if any) on the held-out images weighted to
    # that shard's own label distribution, averaged over the shards; and the final global model on the same.
    own_accuracy: float | None = None
    global_on_shards: float | None = None
    # Bytes a worker moves in a round (down, up: weights, states and control deltas) and the job's stored states.
    traffic: tuple[float, float] = (0.0, 0.0)
    state_bytes: int = 0


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


SHARD_STATE_FILE = "job-8workers.yaml"
PERSONAL = ("fc.*",)  # the digits CNN's classifier head stays with each shard in the FedPer-style runs


def shard_state_settings() -> list[Setting]:
    """Issue 41's rows: SCAFFOLD and FedPer-style personal layers beside FedAvg, FedAvgM and FedProx at 8 workers,
    label skew 0.5 and 0.1, and their central reference (`--shard-state` runs these alone)."""
    job_file, tag = SHARD_STATE_FILE, "8w"
    out = [Setting(f"state: central ({tag} epochs)", job_file, 1, family="shard-state")]
    for split in ("0.5", "0.1"):
        name = f"state: {tag} {_split_name(split)}"
        for strategy in ("federated_averaging", "fedavgm", "fedprox", "scaffold"):
            label = "fedavg" if strategy == "federated_averaging" else strategy
            out.append(Setting(f"{name} {label}", job_file, 8, split, strategy, family="shard-state"))
        out.append(Setting(f"{name} fedper", job_file, 8, split, personal=PERSONAL, family="shard-state"))
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
    if setting.personal:
        distributed["personal_layers"] = list(setting.personal)
    if setting.family == "shard-state":  # `traffic` reads every round's uploads (and the states they trained with)
        distributed["transfer"] = {**distributed.get("transfer", {}), "keep_contributions": True}
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
    if setting.personal:
        # The run's own evaluation scores each shard's personalised model (the in-job per-shard evaluation); the
        # global model's held-out accuracy, what this table compares, is this script's.
        outcome.accuracy = here
    elif here != outcome.accuracy:
        outcome.error = f"the run's evaluations {outcome.accuracy} differ from this script's {here}"
    if setting.family == "shard-state":
        heldout = job_request(setting)["config"]["heldout"]
        outcome.own_accuracy, outcome.global_on_shards = own_distribution_accuracy(job_folder, heldout)
        outcome.traffic, outcome.state_bytes = traffic(job_folder, summary["rounds_completed"], setting.workers,
                                                       shared_server_state=setting.strategy == "scaffold")
    return outcome


def own_distribution_accuracy(job_folder: Path, heldout: str) -> tuple[float, float]:
    """(each shard's final model, the global one) scored on the held-out images weighted to each shard's own
    label distribution (its shard zip's manifest), averaged over the shards. A shard's model is the final model
    with its personal layers (final/shards/, `personal.<name>`) in place: the global one where it keeps none."""
    import zipfile

    import torch
    from safetensors.torch import load_file

    from examples.digits.train import build_model, load_dataset

    x, y = load_dataset(Path(heldout))
    final = load_file(job_folder / "final" / "model.safetensors")

    def per_label(weights: dict[str, torch.Tensor]) -> dict[int, float]:
        model = build_model()
        model.load_state_dict(weights)
        model.eval()
        with torch.no_grad():
            right = model(x).argmax(1) == y
        return {label: float(right[y == label].float().mean()) for label in range(10) if bool((y == label).any())}

    global_scores = per_label(final)
    own, shared = [], []
    for archive in sorted((job_folder / "shards").glob("shard-*.zip")):
        with zipfile.ZipFile(archive) as zf:
            labels = [int(s["label"]) for s in json.loads(zf.read("manifest.json"))["samples"]]
        share = {label: labels.count(label) / len(labels) for label in set(labels)}
        state_file = job_folder / "final" / "shards" / archive.name.replace(".zip", ".safetensors")
        personal = {}
        if state_file.is_file():
            personal = {k.removeprefix("personal."): v for k, v in load_file(state_file).items()
                        if k.startswith("personal.")}
        scores = per_label({**final, **personal}) if personal else global_scores
        own.append(sum(p * scores.get(label, 0.0) for label, p in share.items()))
        shared.append(sum(p * global_scores.get(label, 0.0) for label, p in share.items()))
    return sum(own) / len(own), sum(shared) / len(shared)


def traffic(job_folder: Path, rounds: int, workers: int, *,
            shared_server_state: bool) -> tuple[tuple[float, float], int]:
    """((bytes down, bytes up) per worker per round, bytes of shard and server state stored for the job), from
    the objects the run stored: a worker downloads the round's global weights, the server state its workers get
    (`shared_server_state`: SCAFFOLD's c; other strategies keep theirs to the aggregator) and its shard's state,
    and uploads its contribution (its weights) and its shard's new state. Stored: every upload of a shard state,
    the aggregator's copy of each accepted one, and each round's shared server state (the job keeps them all, as
    `keep_contributions` asks; otherwise superseded states are deleted as rounds go)."""
    def size(path: Path) -> int:
        return path.stat().st_size if path.is_file() else 0

    states = sorted((job_folder / "shard-state").glob("shard-*/round-*.safetensors"))
    kept = sorted((job_folder / "shard-state").glob("shard-*/kept-*.safetensors"))  # the aggregator's copies
    server = sorted((job_folder / "rounds").glob("*/strategy-state.safetensors")) if shared_server_state else []
    down = up = 0
    for r in range(1, rounds + 1):
        down += workers * size(job_folder / "rounds" / f"{r - 1:04d}" / "global.safetensors")
        if shared_server_state:
            down += workers * size(job_folder / "rounds" / f"{r - 1:04d}" / "strategy-state.safetensors")
        up += sum(size(p) for p in (job_folder / "rounds" / f"{r:04d}" / "attempt-1").glob("shard-*.safetensors"))
        up += sum(size(p) for p in states if p.name.startswith(f"round-{r:04d}-"))
        down += sum(size(p) for p in states if p.name.startswith(f"round-{r - 1:04d}-"))
    per = workers * rounds
    return (down / per, up / per), sum(size(p) for p in [*states, *kept, *server])


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
        "Written by `python scripts/accuracy.py` (with [accuracy.json](accuracy.json), each setting's accuracy per",
        "round): every setting runs end to end through `apiary run` (the embedded deployment, CPU workers), seed 0. Held-out accuracy is on the 360 held-out images (one image",
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


def shard_state_table(outcomes: list[Outcome]) -> list[str]:
    """accuracy-shard-state.md's table: global and own-distribution accuracy, traffic and stored state."""
    central = next((o for o in outcomes if o.setting.central and o.accuracy), None)
    fedavg = {o.setting.split: o for o in outcomes if o.setting.strategy == "federated_averaging"
              and not o.setting.personal and not o.setting.central and o.accuracy}
    rows = ["| setting | split | strategy | global held-out accuracy | gap to central (pt) | share of FedAvg's gap "
            "closed | each shard's model on its own labels | global model on each shard's labels | kB per worker per "
            "round down / up (x FedAvg) | state stored per job (kB) | wall time (s) |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for o in outcomes:
        if o.error or not o.accuracy:
            rows.append(f"| {o.setting.name} | | | failed: {o.error} | | | | | | | |")
            continue
        final = o.accuracy[-1]
        if o.setting.central:
            rows.append(f"| {o.setting.name} | {_split_name(o.setting.split)} | central | {final:.3f} | | | | | | | "
                        f"{o.wall_s:.0f} |")
            continue
        gap = "" if central is None else f"{100 * (final - central.accuracy[-1]):+.1f}"
        reference = fedavg.get(o.setting.split)
        closed = ""
        # Only where FedAvg leaves a gap worth closing (2 points), and for a model meant to be global.
        if central is not None and reference is not None and reference is not o and not o.setting.personal \
                and central.accuracy[-1] - reference.accuracy[-1] >= 0.02:
            base = central.accuracy[-1] - reference.accuracy[-1]
            closed = f"{(final - reference.accuracy[-1]) / base:+.0%}"
        ratio = ""
        if reference is not None and reference.traffic[0] and reference.traffic[1]:
            ratio = f" ({o.traffic[0] / reference.traffic[0]:.1f}x / {o.traffic[1] / reference.traffic[1]:.1f}x)"
        strategy = o.setting.strategy + (f" + personal_layers {list(o.setting.personal)}" if o.setting.personal else "")
        rows.append(f"| {o.setting.name} | {_split_name(o.setting.split)} | {strategy} | {final:.3f} | {gap} | "
                    f"{closed} | {o.own_accuracy or 0:.3f} | {o.global_on_shards or 0:.3f} | "
                    f"{o.traffic[0] / 1000:.0f} / {o.traffic[1] / 1000:.0f}{ratio} | {o.state_bytes / 1000:.0f} | "
                    f"{o.wall_s:.0f} |")
    return rows


def write_shard_state_markdown(outcomes: list[Outcome], path: Path, total_s: float, parallel: int) -> None:
    """Issue 41's results page: SCAFFOLD and personal layers beside the shipped strategies."""
    job = yaml.safe_load((DIGITS / SHARD_STATE_FILE).read_text())
    lines = [
        "# Accuracy with state per shard: SCAFFOLD and personal layers (digits example)",
        "",
        "Written by `python scripts/accuracy.py --shard-state` (with [accuracy-shard-state.json]"
        "(accuracy-shard-state.json), each setting's accuracy per round): each setting runs end to end through "
        "`apiary run`",
        f"(embedded, CPU workers), seed 0, with `examples/digits/{SHARD_STATE_FILE}` "
        f"({job['distributed']['num_rounds']} rounds x {job['config']['epochs']} epochs, Adam at learning rate "
        f"{job['config']['learning_rate']}), 8 "
        "workers, `split: {strategy: label_skew, alpha: A}`, as the main [accuracy table](accuracy.md); the central",
        "reference and FedAvg, FedAvgM and FedProx were run again in the same batch, so every ratio compares runs of",
        f"one session ({parallel} at a time, {total_s / 60:.1f} minutes in all, on a 2-core machine shared with",
        "other work). SCAFFOLD runs with its defaults (server_learning_rate 1, option II; the example's Adam makes",
        "`apiary.sdk.Scaffold` take the mean raw gradient as the new control variate). FedPer keeps the classifier",
        f"head `{', '.join(PERSONAL)}` with each shard (`distributed.personal_layers`), FedAvg for the rest.",
        "",
        "*Global held-out accuracy* is the final global model on the 360 held-out images. *Each shard's model on its",
        "own labels* scores each shard's final model (for FedPer: the global model with that shard's personal layers)",
        "on the held-out images weighted to that shard's own label distribution, averaged over the 8 shards; *global",
        "model on each shard's labels* scores the global model the same way. FedPer's global model has an untrained",
        "head, so its global accuracy is not what it is for. Traffic is what each worker downloads and uploads per",
        "round (global weights, the server state and its shard's state down; its contribution, with SCAFFOLD's",
        "control deltas, and its shard's new state up), from the objects the run stored; state stored is every",
        "round's uploaded shard states, the aggregator's copy of each accepted one (under its sha256, so that an",
        "assignment trained twice cannot change it) and the shared server state the job keeps.",
        "",
        *shard_state_table(outcomes), "", "![held-out accuracy per round](accuracy-shard-state.png)", "",
    ]
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
    dashes = {"federated_averaging": "-", "fedavgm": "--", "fedprox": ":", "fedadam": "-.", "scaffold": (0, (5, 1))}
    for ax, job_file in zip(axes[0], files, strict=True):
        for o in outcomes:
            if o.setting.job_file != job_file or not o.accuracy:
                continue
            rounds = range(1, len(o.accuracy) + 1)
            style = {"color": "black", "linewidth": 2.5} if o.setting.central else {
                "color": colours[o.setting.split], "linestyle": dashes[o.setting.strategy]}
            if o.setting.personal:
                style.update(linestyle=(0, (1, 1, 5, 1)), linewidth=2.0)
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
    parser.add_argument("--shard-state", action="store_true", help="run issue 41's settings (SCAFFOLD, personal "
                        "layers, their references) instead, into accuracy-shard-state.md, .png and .json")
    args = parser.parse_args(argv)
    against = json.loads(args.against.read_text()) if args.against else {}
    if not (DIGITS / "data" / "manifest.json").is_file():
        subprocess.run([sys.executable, str(DIGITS / "prepare.py")], check=True)
    chosen = [s for s in (shard_state_settings() if args.shard_state else settings()) if args.only in s.name]
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
    stem = "accuracy-shard-state" if args.shard_state else "accuracy"
    if args.shard_state:
        write_shard_state_markdown(outcomes, args.out / f"{stem}.md", total, args.parallel)
    else:
        write_markdown(outcomes, args.out / f"{stem}.md", total, args.parallel, moved, str(args.against or ""))
    write_plot(outcomes, args.out / f"{stem}.png")
    (args.out / f"{stem}.json").write_text(json.dumps({o.setting.name: o.accuracy for o in outcomes}, indent=1) + "\n")
    print(f"wrote {args.out / stem}.md, .png and .json in {total / 60:.1f} min")
    if moved:
        print("largest difference from " + str(args.against) + ": " + ", ".join(
            f"{name} {value:.2f} pt" for name, value in sorted(moved.items(), key=lambda kv: -kv[1])[:5]))
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
