"""What an assignment's run is given: the worker that took it, seen through a narrow port (`Host`), and the
job's folders on it (`Workspace`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from apiary.bus import Bus
from apiary.contracts import Assignment
from apiary.settings import Settings
from apiary.trainers import Trainer
from services.worker.bundles import BundleCache
from services.worker.model_cache import ModelCache

if TYPE_CHECKING:
    from services.worker.secagg_inbox import SecAggInbox


class Host(Protocol):
    """What an assignment's run needs of the worker that took it (it changes nothing there)."""

    @property
    def bus(self) -> Bus:
        """Where reports go."""

    @property
    def settings(self) -> Settings:
        """The worker's settings."""

    @property
    def worker_id(self) -> str:
        """Whose reports they are."""

    @property
    def cache(self) -> Path:
        """The worker's folder."""

    @property
    def models(self) -> ModelCache:
        """Base models kept on this worker."""

    @property
    def bundles(self) -> BundleCache:
        """Code bundles kept on this worker."""

    @property
    def secagg(self) -> SecAggInbox:
        """The aggregator's secure-aggregation stages for this worker's shards."""

    def span_attributes(self, a: Assignment) -> dict[str, Any]:
        """What every span of an assignment says about it."""

    def skip_ended(self, a: Assignment) -> None:
        """Log that an assignment of a job that ended is not trained."""

    def trainer_for(self, a: Assignment) -> Trainer:
        """The trainer for the assignment's job; TrainerError if there is none."""

    async def failed(self, a: Assignment, error: str) -> None:
        """Report that the assignment failed, and why."""


class Workspace:
    """A job's folders on this worker: one working folder per job, reused round after round (a worker
    trains one shard at a time), its files replaced whole; the user's output folder starts empty
    every call."""

    def __init__(self, job_dir: Path) -> None:
        self.job_dir = job_dir
        self.work = job_dir / "work"
        self.weights = self.work / "global.safetensors"  # the round's global weights
        self.result = self.work / "result.safetensors"  # the trained weights
        self.out_dir = self.work / "out"

    def clear_outputs(self) -> None:
        """Empty the output folder left by the previous round, and remove its trained result: the child renames
        this round's to a free name (see `transfers.fetch_weights`)."""
        self.result.unlink(missing_ok=True)
        if self.out_dir.is_dir() and any(self.out_dir.iterdir()):
            shutil.rmtree(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
