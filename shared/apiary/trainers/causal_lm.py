"""The built-in causal-LM trainer (`causal_lm`, for jobs without an entrypoint): fine-tunes the job's
base model with LoRA (or all its weights) in a child process, with the user-function trainer's process
machinery (signals, exit with the worker, timeout); the round itself is causal_lm_train's."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from apiary.strategies.format import UpdateFormat
from apiary.trainers import environment
from apiary.trainers.base import (
    BUILT_IN,
    MetricsCallback,
    TrainCall,
    TrainerError,
    TrainerSetup,
    TrainResult,
    register_trainer,
)
from apiary.trainers.causal_lm_config import CausalLMConfig
from apiary.trainers.process import ChildProcess, ChildTrainer

_TRUE = ("1", "true", "yes", "on")


def _quiet_openmp() -> dict[str, str]:
    """OpenMP threads that sleep when idle, unless the user chose a policy: no user code runs in this child,
    and spinning ones made a busy CPU's work many times slower (a 135M model's greedy token took 2.6 s
    instead of 0.15 s with 2 threads on a 2-core machine that other processes kept busy)."""
    user = environment.user_environment().get(environment.OPENMP_WAIT, os.environ.get(environment.OPENMP_WAIT))
    return {environment.OPENMP_WAIT: user or "PASSIVE"}


class CausalLMTrainer(ChildTrainer):
    """A warm child process that fine-tunes the base model for one assignment at a time."""

    def __init__(self, setup: TrainerSetup) -> None:
        super().__init__(ChildProcess([], setup.name, {**_quiet_openmp(), **setup.environment}))

    def update_format(self, env: Mapping[str, Any]) -> UpdateFormat:
        """Adapter tensors alone with `use_peft` (the config's default), else all weights."""
        peft = env.get("USE_PEFT", CausalLMConfig.model_fields["use_peft"].default)
        return UpdateFormat.of(adapter_only=peft is True or str(peft).lower() in _TRUE)

    async def train(self, call: TrainCall, *, timeout: float | None = None,
                    on_metrics: MetricsCallback | None = None) -> TrainResult:
        """Fine-tune on the call's shard; TrainerError with one clear line if that fails."""
        if not call.model_path:
            raise TrainerError("the causal_lm trainer needs the job's base model, and the assignment names none")
        out = await self._call("causal_lm.train", call, timeout, on_metrics)
        return TrainResult(samples=out["samples"], size=out["size"], sha256=out["sha256"], metrics=out["metrics"],
                           state_size=out.get("state_size"), state_sha256=out.get("state_sha256"))

    async def init_task(self, call: TrainCall, *, timeout: float | None = None) -> bool:
        """Round 0 of a job without peft: the base model's own weights, from the worker's cache."""
        if not call.model_path:
            raise TrainerError("the causal_lm trainer's initial weights are its base model's, and the init "
                               "assignment names none")
        out = await self._call("causal_lm.init", call, timeout)
        return bool(out["found"])

    async def merge_task(self, call: TrainCall, *, timeout: float | None = None) -> None:
        """The final adapter merged into the base model from the worker's cache, saved as a model folder."""
        if not call.model_path:
            raise TrainerError("merging the adapter needs the job's base model, and the merge assignment names none")
        await self._call("causal_lm.merge", call, timeout)

    async def evaluate_task(self, call: TrainCall, *, timeout: float | None = None) -> dict[str, float] | None:
        """The global weights' exact match and loss on the held-out records (the call's dataset)."""
        if not call.model_path or not call.dataset.get("data_root"):
            raise TrainerError("the causal_lm trainer evaluates the job's base model on its eval_dataset_id, and "
                               "the evaluate assignment names no model or dataset")
        out = await self._call("causal_lm.evaluate", call, timeout, None)
        return dict(out["metrics"]) if out["found"] else None


register_trainer(BUILT_IN, CausalLMTrainer)
