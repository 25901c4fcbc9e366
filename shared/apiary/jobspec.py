"""The job request: what a user or another system asks Apiary to train."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from apiary.strategies import DEFAULT_STRATEGY

ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")
DEFAULT_FUNCTION = "fl_train_model"
FEDPROX = "fedprox"  # the strategy whose parameter the training loop needs (env PROXIMAL_MU)


def parse_entrypoint(entrypoint: str) -> tuple[str, str]:
    """`pkg.module:function` as (module, function); the function defaults to fl_train_model."""
    module, _, function = entrypoint.partition(":")
    return module, function or DEFAULT_FUNCTION


class DistributedConfig(BaseModel):
    """How rounds run: how many, on how many workers, and how failures are tolerated."""

    model_config = ConfigDict(extra="forbid")

    num_rounds: int = Field(default=1, ge=1, le=100_000)
    steps_per_round: int | None = Field(default=None, ge=1)
    min_workers: int = Field(default=1, ge=1)
    max_workers: int = Field(default=1, ge=1, le=10_000)
    aggregation_timeout: float = Field(default=600.0, gt=0, le=7 * 24 * 3600)
    fault_tolerance: int = Field(default=1, ge=0)
    # Checked against the strategy registry by `strategy_errors`, where the strategies are loaded (the
    # scheduler): the tracker validates requests too and must not load torch.
    strategy: str = Field(default=DEFAULT_STRATEGY, min_length=1, max_length=100)
    strategy_params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _min_le_max(self) -> DistributedConfig:
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"min_workers ({self.min_workers}) must not exceed max_workers ({self.max_workers})"
            )
        return self


class SplitConfig(BaseModel):
    """How the sharder splits the dataset: random (default), label skew or by group."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["random", "label_skew", "group"] = "random"
    seed: int = 0
    alpha: float = Field(default=0.5, gt=0, description="Dirichlet concentration for label_skew")
    key: str = Field(default="group", description="sample field that names the group, for group")


class WorkerSelection(BaseModel):
    """Where shards train: any worker from the pool, or each shard on one named worker."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["pool", "pinned"] = "pool"
    workers: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _pinned_needs_workers(self) -> WorkerSelection:
        if self.mode == "pinned" and not self.workers:
            raise ValueError("mode 'pinned' needs 'workers': the worker id for each shard")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError("'workers' names a worker twice")
        return self

    @property
    def pinned(self) -> list[str]:
        """The worker each shard trains on, or [] in pool mode."""
        return list(self.workers) if self.mode == "pinned" else []


class JobSpec(BaseModel):
    """A validated job request."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    entrypoint: str
    dataset: str | None = None
    dataset_id: str | None = None
    model: str | None = None
    model_id: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    worker_selection: WorkerSelection = Field(default_factory=WorkerSelection)
    split: SplitConfig = Field(default_factory=SplitConfig)
    use_peft: bool = False

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, value: str) -> str:
        if not ENTRYPOINT_RE.match(value):
            raise ValueError("expected 'package.module:function' (function defaults to fl_train_model)")
        return value

    @field_validator("config")
    @classmethod
    def _config_scalars(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, item in value.items():
            if not re.match(r"^[A-Za-z_]\w*$", key):
                raise ValueError(f"config key {key!r} must be an identifier (it becomes env[{key.upper()!r}])")
            if item is not None and not isinstance(item, str | int | float | bool | list | dict):
                raise ValueError(f"config value for {key!r} must be JSON-like")
        return value

    @model_validator(mode="after")
    def _dataset_given(self) -> JobSpec:
        if not self.dataset and not self.dataset_id:
            raise ValueError("give 'dataset' (a path or URI) or 'dataset_id'")
        if self.dataset and self.dataset_id:
            raise ValueError("give either 'dataset' or 'dataset_id', not both")
        if self.model and self.model_id:
            raise ValueError("give either 'model' or 'model_id', not both")
        pinned = self.worker_selection.pinned
        if pinned and len(pinned) < self.distributed.min_workers:
            raise ValueError(
                f"{len(pinned)} pinned workers cannot satisfy min_workers={self.distributed.min_workers}"
            )
        return self

    @property
    def module(self) -> str:
        """The entrypoint's module path."""
        return parse_entrypoint(self.entrypoint)[0]

    @property
    def function(self) -> str:
        """The entrypoint's function name."""
        return parse_entrypoint(self.entrypoint)[1]

    @property
    def num_shards(self) -> int:
        """How many shards the dataset is split into: one per pinned worker, else max_workers."""
        return len(self.worker_selection.pinned) or self.distributed.max_workers

    def env(self, round_index: int) -> dict[str, Any]:
        """The env dict the user's function sees: config keys upper-cased plus round facts."""
        env = {key.upper(): value for key, value in self.config.items()}
        env["STEPS_PER_ROUND"] = self.distributed.steps_per_round
        env["ROUND"] = round_index
        env["NUM_ROUNDS"] = self.distributed.num_rounds
        if self.distributed.strategy == FEDPROX:
            # The proximal term lives in the training loop: the user's code (or the built-in trainer) reads it.
            env["PROXIMAL_MU"] = float(self.distributed.strategy_params.get("proximal_mu", 0.0))
        return env


class FieldError(BaseModel):
    """One bad field of a rejected request."""

    field: str
    message: str


def field_errors(error: ValidationError) -> list[FieldError]:
    """Turn a pydantic error into one line per bad field, in the request's own terms."""
    out = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(request)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        out.append(FieldError(field=field, message=message))
    return out


def describe_errors(errors: list[FieldError]) -> str:
    """One line naming each bad field."""
    return "; ".join(f"{e.field}: {e.message}" for e in errors)


def strategy_errors(spec: JobSpec) -> list[FieldError]:
    """The job's strategy checked against the registry and the job's sizes: one error per bad field, none
    if it can run. Imports the strategies (and torch), so only the scheduler calls it."""
    from apiary.strategies import base

    distributed = spec.distributed
    try:
        base.lookup(distributed.strategy)
    except ValueError as e:
        return [FieldError(field="distributed.strategy", message=str(e))]
    try:
        strategy = base.create(distributed.strategy, distributed.strategy_params)
        strategy.check_job(spec.num_shards, distributed.min_workers)
    except ValueError as e:
        return [FieldError(field="distributed.strategy_params", message=str(e))]
    return []
