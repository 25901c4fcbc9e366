"""A toy `fl_train_model` that keeps state with its shard (issue 41): the toy's weights (shard s adds s + 1), and a
state that counts the shard's trained rounds and names the shard, so a test sees whether it followed the shard.

env FAIL: {"<round>": [shards]} makes those shards raise in that round; env BAD_STATE likewise makes them return a
state of another shape than last round's.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.toyjobs.toy import fl_init_weights

__all__ = ["fl_init_weights", "fl_train_model"]


def fl_train_model(payload: dict[str, Any], out_dir: str, logger: Any = None) -> dict[str, Any]:
    """Add (shard + 1) to every float weight but the personal ones; count this round in the shard's state."""
    env, shard = payload["env"], int(payload["dataset"]["shard_index"])
    round_key = str(payload["round"]["index"])
    if shard in (env.get("FAIL") or {}).get(round_key, []):
        raise RuntimeError(f"toy failure on shard {shard}")
    state = payload["state"]
    if state and int(state["shard"]) != shard:
        raise RuntimeError(f"shard {shard} was handed shard {int(state['shard'])}'s state")
    visits = int(state["visits"][0]) if state else 0
    weights = {k: v.clone() for k, v in payload["initial_weights"].items()}
    for tensor in weights.values():
        if tensor.is_floating_point():
            tensor.add_(shard + 1)
    bad = shard in (env.get("BAD_STATE") or {}).get(round_key, [])
    new_state = {"visits": torch.tensor([visits + 1] * (2 if bad else 1), dtype=torch.int64),
                 "shard": torch.tensor(shard, dtype=torch.int64)}
    return {"weights": weights, "samples": 4, "state": new_state, "metrics": {"visits_before": float(visits)}}
