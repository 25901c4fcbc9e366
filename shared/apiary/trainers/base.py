"""What a worker runs for an assignment: the Trainer interface, its call and result, and the registry
that picks a trainer for a job (the user's function when the job names an entrypoint, else a built-in)."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from apiary.strategies.format import UpdateFormat

USER_FUNCTION = "user_function"
# The trainer a job without an entrypoint gets (the built-in causal-LM fine-tuner, in its own issue).
BUILT_IN = "causal_lm"

MetricsCallback = Callable[[dict[str, Any]], None]


class TrainerError(Exception):
    """Training failed; the message is one line saying how and where."""


@dataclass
class TrainCall:
    """One assignment for a trainer, with files for its inputs and outputs (`module` and `function` name
    the user's entrypoint; a built-in trainer has none and leaves them empty)."""

    module: str
    function: str
    weights_path: str
    result_path: str
    out_dir: str
    env: dict[str, Any]
    dataset: dict[str, Any]
    round: dict[str, Any]
    job: dict[str, Any]
    # The job's base model in the worker's cache (a model folder or a .gguf file), for built-in trainers.
    model_path: str | None = None
    # The job's code bundle unpacked in the worker's cache: the child runs with it first on sys.path.
    code_path: str | None = None
    # Differential privacy with clip_on worker: the result's update is clipped to this L2 norm before upload.
    clipping_norm: float | None = None
    # ... and with noise_on worker, Gaussian noise of this std is added to the clipped update (seeded in tests only).
    noise_std: float | None = None
    noise_seed: int | None = None
    # The job's `distributed.transfer` (apiary.wire_settings.TransferSettings as a dict) where it encodes uploads.
    transfer: dict[str, Any] | None = None
    # The shard's state (apiary.shard_state): the file of its latest one (None: it has none yet), the server state
    # every worker gets (SCAFFOLD's c), where the new one goes, the most bytes it may take, and the personal layers.
    state_path: str | None = None
    server_state_path: str | None = None
    state_result_path: str | None = None
    state_limit: int | None = None
    personal_layers: list[str] = field(default_factory=list)


@dataclass
class TrainResult:
    """What training returned, its weights already written to `result_path` (`size` bytes with this
    `sha256`)."""

    samples: int
    size: int
    sha256: str
    metrics: dict[str, float] = field(default_factory=dict)
    # The shard's new state, written to the call's `state_result_path`, if the training returned one.
    state_size: int | None = None
    state_sha256: str | None = None

    def has_samples(self) -> bool:
        """Whether `samples` is a positive int, as the average's weighting needs."""
        return not isinstance(self.samples, bool) and isinstance(self.samples, int) and self.samples > 0


class Trainer(ABC):
    """Trains one shard for one round at a time, its work kept apart from the worker's process."""

    @abstractmethod
    def update_format(self, env: Mapping[str, Any]) -> UpdateFormat:
        """The format of the updates this trainer returns for a job with this `env`."""

    @abstractmethod
    async def train(self, call: TrainCall, *, timeout: float | None = None,
                    on_metrics: MetricsCallback | None = None) -> TrainResult:
        """Train; raise TrainerError with one clear line if training fails."""

    async def init_task(self, call: TrainCall, *, timeout: float | None = None) -> bool:
        """An init assignment: write the job's initial weights to `call.result_path`; False where this trainer
        (or the job's code) makes none. TrainerError with one clear line if it fails."""
        return False

    async def merge_task(self, call: TrainCall, *, timeout: float | None = None) -> None:
        """A merge assignment: the adapter at `call.weights_path` merged into the base model (`call.model_path`),
        saved as a Hugging Face model folder at `call.result_path`. TrainerError with one clear line if it fails
        (or this trainer has no adapter to merge)."""
        raise TrainerError("this job's trainer has no adapter to merge into a base model")

    async def evaluate_task(self, call: TrainCall, *, timeout: float | None = None) -> dict[str, float] | None:
        """An evaluate assignment: the metrics of the global weights at `call.weights_path`; None where this
        trainer (or the job's code) has no evaluation. TrainerError with one clear line if it fails."""
        return None

    @property
    @abstractmethod
    def pid(self) -> int | None:
        """The process that trains (its GPU readings are the worker's), while one runs."""

    @abstractmethod
    async def start(self) -> None:
        """Get ready ahead of the first call (load what every call needs)."""

    @abstractmethod
    async def stop(self) -> None:
        """Release what the trainer holds."""


@dataclass(frozen=True)
class TrainerSetup:
    """What a worker gives every trainer it makes: where user code lives, a name for its processes and
    variables to set in them (the GPU it may use)."""

    code_paths: list[str] = field(default_factory=list)
    name: str = "apiary-trainer"
    environment: dict[str, str] = field(default_factory=dict)


TrainerFactory = Callable[[TrainerSetup], Trainer]
_factories: dict[str, TrainerFactory] = {}
# Trainers whose module registers them when first asked for (not imported by every process that imports this
# package).
_REGISTERED_ON_USE = {BUILT_IN: "apiary.trainers.causal_lm"}


def register_trainer(name: str, factory: TrainerFactory) -> None:
    """Make a trainer available under `name` (each trainer module registers itself)."""
    _factories[name] = factory


def trainer_name(entrypoint: str | None) -> str:
    """The trainer for a job: the user's function where the job names one, else the built-in one."""
    return USER_FUNCTION if entrypoint else BUILT_IN


def make_trainer(name: str, setup: TrainerSetup) -> Trainer:
    """A new trainer of this name; ValueError naming the known ones if there is none."""
    if name not in _factories and name in _REGISTERED_ON_USE:
        importlib.import_module(_REGISTERED_ON_USE[name])
    factory = _factories.get(name)
    if factory is None:
        known = sorted({*_factories, *_REGISTERED_ON_USE})
        raise ValueError(f"no trainer {name!r} on this worker: expected one of {known}")
    return factory(setup)
