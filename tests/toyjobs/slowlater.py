"""The toy job (tests.toyjobs.toy) whose training sleeps env SLOW_SECONDS (default 600) from round env SLOW_FROM
(default 3) on: a round still training when an earlier round's evaluation ends the job."""

from __future__ import annotations

import time
from typing import Any

from tests.toyjobs.toy import fl_evaluate_model, fl_init_weights
from tests.toyjobs.toy import fl_train_model as toy_train_model

__all__ = ["fl_evaluate_model", "fl_init_weights", "fl_train_model"]


def fl_train_model(payload: dict[str, Any], out_dir: str, logger: Any = None) -> dict[str, Any]:
    """The toy's training, after a long sleep in the rounds from SLOW_FROM on."""
    env = payload["env"]
    if int(payload["round"]["index"]) >= int(env.get("SLOW_FROM", 3)):
        time.sleep(float(env.get("SLOW_SECONDS", 600)))
    return toy_train_model(payload, out_dir, logger)
