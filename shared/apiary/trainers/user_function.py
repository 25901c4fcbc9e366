"""The user-function trainer: the job's `fl_train_model` (and its `fl_init_weights`, `fl_evaluate_model`)
run in a child process, so user code that raises, exits or hangs cannot take the calling service down.

One child is kept warm between calls (imports of torch and the user's module are paid once);
if it dies or must be killed, the next call starts a fresh one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from apiary.strategies.format import UpdateFormat
from apiary.trainers.base import (
    USER_FUNCTION,
    MetricsCallback,
    TrainCall,
    Trainer,
    TrainerSetup,
    TrainResult,
    register_trainer,
)
from apiary.trainers.process import ChildProcess, ChildTrainer

_TRUE = ("1", "true", "yes", "on")


class UserCodeRunner(ChildTrainer):
    """A warm child process that runs one user call at a time."""

    def __init__(self, code_paths: list[str] | None = None, name: str = "apiary-user-code",
                 environment: dict[str, str] | None = None) -> None:
        super().__init__(ChildProcess([os.getcwd(), *(code_paths or [])], name, dict(environment or {})))

    def update_format(self, env: Mapping[str, Any]) -> UpdateFormat:
        """Adapter tensors for a job with `use_peft` in its config (the function returns only those),
        else all weights."""
        peft = env.get("USE_PEFT")
        return UpdateFormat.of(adapter_only=peft is True or str(peft).lower() in _TRUE)

    async def train(self, call: TrainCall, *, timeout: float | None = None,
                    on_metrics: MetricsCallback | None = None) -> TrainResult:
        """Run the user's training function; raise UserCodeError with one clear line if it fails."""
        out = await self._call("train", call, timeout, on_metrics)
        return TrainResult(samples=out["samples"], size=out["size"], sha256=out["sha256"], metrics=out["metrics"],
                           state_size=out.get("state_size"), state_sha256=out.get("state_sha256"))

    async def init_weights(self, module: str, env: dict[str, Any], target: Path, *, timeout: float) -> bool:
        """Write the module's `fl_init_weights(env)` to `target`; False if the module has none."""
        return await self.init_task(_task_call(module, env, result_path=str(target)), timeout=timeout)

    async def evaluate(
        self, module: str, env: dict[str, Any], weights_path: Path, *, timeout: float
    ) -> dict[str, float] | None:
        """The module's `fl_evaluate_model(weights, env)` metrics; None if it has none."""
        return await self.evaluate_task(_task_call(module, env, weights_path=str(weights_path)), timeout=timeout)

    async def init_task(self, call: TrainCall, *, timeout: float | None = None) -> bool:
        """An init assignment: write `call.module`'s `fl_init_weights(call.env)` to `call.result_path`;
        False if the module has none. UserCodeError with one clear line if it fails."""
        out = await self._call("init", call, timeout)
        return bool(out["found"])

    async def evaluate_task(self, call: TrainCall, *, timeout: float | None = None) -> dict[str, float] | None:
        """An evaluate assignment: `call.module`'s `fl_evaluate_model` on the weights at `call.weights_path`;
        None if the module has none. UserCodeError with one clear line if it fails."""
        out = await self._call("evaluate", call, timeout)
        return out["metrics"] if out["found"] else None


def _task_call(module: str, env: dict[str, Any], *, weights_path: str = "", result_path: str = "") -> TrainCall:
    """A call of one of the module's other functions, outside any assignment."""
    return TrainCall(module=module, function="", weights_path=weights_path, result_path=result_path, out_dir="",
                     env=env, dataset={}, round={}, job={})


def _from_setup(setup: TrainerSetup) -> Trainer:
    return UserCodeRunner(setup.code_paths, name=setup.name, environment=setup.environment)


register_trainer(USER_FUNCTION, _from_setup)
