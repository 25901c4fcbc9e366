"""A toy `fl_train_model` whose result is known exactly: shard s adds (s + 1) to every weight.

env MODE picks a behaviour: ok (default), raise, exit, hang, nan, badshape, zero_samples, slow, gated (held until
the file env GATE names exists, its "{round}" replaced by the round's index and "{attempt}" by the attempt's (in
mode async, the task's number): the test decides when the shard reports in each round, or when each task does,
waiting at most GATE_SECONDS, default 300).
env FAIL_SHARDS (a list) limits a failure mode to those shards; the others behave normally.
env EVAL_MODE raise or slow makes fl_evaluate_model fail or sleep (in the rounds EVAL_FAIL_ROUNDS lists, or all).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch


def make_dataset(root: Path, num_samples: int = 12, *, groups: int = 0) -> Path:
    """Write a toy dataset folder: one small text file per sample, and a manifest."""
    samples = []
    (root / "samples").mkdir(parents=True, exist_ok=True)
    for i in range(num_samples):
        path = f"samples/{i:04d}.txt"
        (root / path).write_text(f"sample {i}\n")
        sample: dict[str, Any] = {"path": path, "label": i % 3}
        if groups:
            sample["group"] = f"g{i % groups}"
        samples.append(sample)
    (root / "manifest.json").write_text(json.dumps({"name": "toy", "samples": samples}))
    return root


def fl_init_weights(env: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Small integer-valued weights, so averages are exact in float32."""
    weights = {"layer.weight": torch.zeros(2, 3), "layer.bias": torch.arange(2, dtype=torch.float32),
               "steps": torch.tensor(0, dtype=torch.int64)}
    if env.get("WIDTH"):  # a wider tensor, for tests that look at the statistics of an update
        weights["wide.weight"] = torch.zeros(int(env["WIDTH"]))
    if env.get("DTYPE"):  # the float tensors in another dtype, e.g. bfloat16
        dtype = getattr(torch, str(env["DTYPE"]))
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    return weights


def _count_samples(data_root: str) -> int:
    manifest = json.loads((Path(data_root) / "manifest.json").read_text())
    return len(manifest["samples"])


def hold_at_gate(payload: dict[str, Any]) -> None:
    """Wait until the file env GATE names exists ("{round}" and "{attempt}" in it replaced by the round's), at most
    GATE_SECONDS."""
    env, at = payload["env"], payload["round"]
    gate = Path(env["GATE"].replace("{round}", str(at["index"])).replace("{attempt}", str(at.get("attempt", 1))))
    deadline = time.monotonic() + float(env.get("GATE_SECONDS", 300))
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


class Gates:
    """The test's side of the toy's gates (mode gated, `hold_at_gate`): a training call waits until the file for its
    round (or, with `by="attempt"`, for its attempt: in mode async a task's number) exists, so a test decides when
    each reports instead of racing a sleep."""

    def __init__(self, folder: Path, *, opened: int = 0, by: str = "round") -> None:
        self.path = str(folder / f"gate-{{{by}}}")
        self._by = by
        self.open_through(opened)

    def open_through(self, last: int, first: int = 1) -> None:
        """Open the gates of rounds (attempts) `first` to `last`."""
        for index in range(first, last + 1):
            Path(self.path.replace(f"{{{self._by}}}", str(index))).touch()


def fl_train_model(payload: dict[str, Any], out_dir: str, logger: Any = None) -> dict[str, Any]:
    """Add (shard + 1) to every float weight; fail as env MODE asks."""
    env = payload["env"]
    shard = int(payload["dataset"]["shard_index"])
    fail_shards = env.get("FAIL_SHARDS")
    mode = env.get("MODE", "ok") if fail_shards is None or shard in fail_shards else "ok"
    if mode == "raise":
        raise RuntimeError(f"toy failure on shard {shard}")
    if mode == "exit":
        os._exit(3)
    if mode == "hang":
        time.sleep(3600)
    if mode == "slow":
        time.sleep(float(env.get("SLOW_SECONDS", 2.0)))
    if mode == "gated":
        hold_at_gate(payload)
    weights = {k: v.clone() for k, v in payload["initial_weights"].items()}
    for tensor in weights.values():
        if tensor.is_floating_point():
            tensor.add_(shard + 1)
        else:
            tensor.add_(1)
    if env.get("NOISE"):  # a different update for every value: noise_update(round, shard, name, shape)
        for name in sorted(weights):
            if weights[name].is_floating_point():
                weights[name].add_(noise_update(payload["round"]["index"], shard, name, tuple(weights[name].shape),
                                                float(env["NOISE"])))
    if mode == "nan":
        weights["layer.weight"][0, 0] = float("nan")
    if mode == "badshape":
        weights["layer.weight"] = torch.zeros(3, 3)
    samples = _count_samples(payload["dataset"]["data_root"])
    if mode == "zero_samples":
        samples = 0
    loss = 1.0 / (payload["round"]["index"] + shard)
    if logger is not None:
        for step in range(3):
            logger.log_metrics(loss=loss + 0.1 * (2 - step), step=step)
    Path(out_dir, f"shard-{shard}.txt").write_text(f"round {payload['round']['index']}\n")
    return {"weights": weights, "samples": samples, "metrics": {"loss": loss}}


def noise_update(round_index: int, shard: int, name: str, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """The noise the toy adds (env NOISE) to tensor `name` of shard `shard` in round `round_index`."""
    seed = 1000 * round_index + 10 * shard + sum(name.encode())
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def fl_evaluate_model(weights: dict[str, torch.Tensor], env: dict[str, Any]) -> dict[str, float]:
    """A metric computed from the weights, so the test can check evaluation ran on them; env EVAL_MODE
    raise, slow or gated (in the rounds listed in EVAL_FAIL_ROUNDS, or all) makes it fail, sleep EVAL_SECONDS, or
    wait until the file env EVAL_GATE names exists (at most GATE_SECONDS)."""
    fail_rounds = env.get("EVAL_FAIL_ROUNDS")
    if fail_rounds is None or env.get("ROUND") in fail_rounds:
        if env.get("EVAL_MODE") == "raise":
            raise RuntimeError(f"toy evaluation failure in round {env.get('ROUND')}")
        if env.get("EVAL_MODE") == "slow":
            time.sleep(float(env.get("EVAL_SECONDS", 2.0)))
        if env.get("EVAL_MODE") == "gated":
            deadline = time.monotonic() + float(env.get("GATE_SECONDS", 300))
            while not Path(env["EVAL_GATE"]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    return {"weight_sum": float(weights["layer.weight"].sum())}
