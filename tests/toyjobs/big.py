"""A toy job with weights of several MiB (env BIG_MIB, default 12), for multipart transfers: shard s adds
(s + 1) / 8 to every float weight, so the FedAvg is known in closed form."""

from __future__ import annotations

from typing import Any

import torch

from tests.toyjobs.toy import _count_samples, make_dataset

__all__ = ["fl_init_weights", "fl_train_model", "make_dataset"]


def fl_init_weights(env: dict[str, Any]) -> dict[str, torch.Tensor]:
    """BIG_MIB MiB of float32 in two tensors, seeded, plus an integer counter."""
    elements = int(float(env.get("BIG_MIB", 12)) * 2**20 / 4)
    g = torch.Generator().manual_seed(7)
    return {"big.weight": torch.randn(elements - 1000, generator=g), "big.bias": torch.randn(1000, generator=g),
            "steps": torch.tensor(0, dtype=torch.int64)}


def fl_train_model(payload: dict[str, Any], out_dir: str, logger: Any = None) -> dict[str, Any]:
    """Add (shard + 1) / 8 to every float weight."""
    shard = int(payload["dataset"]["shard_index"])
    weights = {k: v.clone() for k, v in payload["initial_weights"].items()}
    for tensor in weights.values():
        tensor.add_((shard + 1) / 8 if tensor.is_floating_point() else 1)
    return {"weights": weights, "samples": _count_samples(payload["dataset"]["data_root"])}
