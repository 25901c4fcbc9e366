"""The digits example on an unequal fleet, for scripts/bench_async.py: each training task takes at least
PACE_SECONDS (a stand-in for a real model's step time, so a worker's speed shows over the platform's own
overheads), and the shards listed in SLOW_SHARDS take SLOW_FACTOR times as long (a slower GPU)."""

from __future__ import annotations

import time
from typing import Any

from examples.digits.train import fl_evaluate_model, fl_init_weights
from examples.digits.train import fl_train_model as train

__all__ = ["fl_evaluate_model", "fl_init_weights", "fl_train_model"]


def fl_train_model(payload: dict[str, Any], out_dir: str, logger: Any = None) -> dict[str, Any]:
    """Train as the digits example does, then wait out the rest of this shard's pace."""
    started = time.monotonic()
    result = train(payload, out_dir, logger)
    env = payload["env"]
    pace = float(env.get("PACE_SECONDS", 0.0))
    if int(payload["dataset"].get("shard_index", 0)) in (env.get("SLOW_SHARDS") or []):
        pace *= float(env.get("SLOW_FACTOR", 5.0))
    time.sleep(max(0.0, pace - (time.monotonic() - started)))
    return result
