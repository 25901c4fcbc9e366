"""The toy job (tests.toyjobs.toy) with a side effect a test can see: importing this module, and each call
of its functions, appends a JSON line (which process: pid, parent pid, multiprocessing name, argv) to the
file named by env TOYJOB_WITNESS. A control-plane process that imported a job's code would leave a line."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from typing import Any

import torch

from tests.toyjobs import toy

WITNESS = "TOYJOB_WITNESS"


def _witness(event: str) -> None:
    path = os.environ.get(WITNESS)
    if path:
        record = {"event": event, "pid": os.getpid(), "ppid": os.getppid(),
                  "process": multiprocessing.current_process().name, "argv": list(sys.argv)}
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


_witness("import")


def fl_init_weights(env: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The toy's initial weights, witnessed."""
    _witness("init")
    return toy.fl_init_weights(env)


def fl_train_model(payload: dict[str, Any], out_dir: str, logger: Any = None) -> dict[str, Any]:
    """The toy's training, witnessed."""
    _witness("train")
    return toy.fl_train_model(payload, out_dir, logger)


def fl_evaluate_model(weights: dict[str, torch.Tensor], env: dict[str, Any]) -> dict[str, float]:
    """The toy's evaluation, witnessed."""
    _witness("evaluate")
    return toy.fl_evaluate_model(weights, env)
