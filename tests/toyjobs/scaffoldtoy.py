"""A toy `fl_train_model` for SCAFFOLD (issue 41): the toy's weights as a small linear layer trained by plain SGD on
shard-dependent data, its gradients corrected by apiary.sdk.Scaffold, so every round moves the control variates.

env MODE slow with FAIL_SHARDS (a list) makes those shards sleep SLOW_SECONDS first; MODE gated holds them at the
toy's gate (env GATE) instead, until the test opens it (a test kills a process meanwhile).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from apiary.sdk import Scaffold, get_weights
from tests.toyjobs.toy import fl_init_weights, hold_at_gate

__all__ = ["fl_init_weights", "fl_train_model"]
LR, STEPS = 0.05, 3


class ToyModel(torch.nn.Module):
    """The toy's tensors (layer.weight, layer.bias, steps) as a module."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.register_buffer("steps", torch.tensor(0, dtype=torch.int64))


def fl_train_model(payload: dict[str, Any], out_dir: str, logger: Any = None) -> dict[str, Any]:
    """Three SGD steps towards a target that differs by shard, each corrected by SCAFFOLD."""
    env, shard = payload["env"], int(payload["dataset"]["shard_index"])
    if shard in (env.get("FAIL_SHARDS") or []):
        if env.get("MODE") == "slow":
            time.sleep(float(env.get("SLOW_SECONDS", 2.0)))
        elif env.get("MODE") == "gated":
            hold_at_gate(payload)
    model = ToyModel()
    model.load_state_dict(payload["initial_weights"])
    scaffold = Scaffold(model, payload, lr=LR)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.linspace(-1.0, 1.0, 12).reshape(4, 3) * (shard + 1)
    target = torch.full((4, 2), float(shard))
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model.layer(x), target).backward()
        scaffold.correct()
        optimizer.step()
    model.steps.add_(1)
    samples = len(json.loads((Path(payload["dataset"]["data_root"]) / "manifest.json").read_text())["samples"])
    return scaffold.finish({"weights": get_weights(model), "samples": samples})
