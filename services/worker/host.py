"""What an assignment's run is given: the worker that took it, seen through a narrow port (`Host`), and the
job's folders on it (`Workspace`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Coroutine
from dataclasses import dataclass
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

# A set-aside run's folder (`Workspace.set_aside`) is under the job's working folder; it holds the run's assignment
# until its result is reported.
ASIDE, ASSIGNMENT = "aside", "assignment.json"


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
    def stopping(self) -> bool:
        """Whether the worker is stopping (its steps still running are being stopped)."""

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

    def hand_off(self, a: Assignment, steps: Coroutine[Any, Any, None]) -> None:
        """Let the assignment's last `steps` go on without the training slot (they are stopped if its job ends or
        the worker stops)."""


class Workspace:
    """A job's folders on this worker: one working folder per job, reused round after round (a worker
    trains one shard at a time), its files replaced whole; the user's output folder starts empty
    every call. A run whose last steps go on after it gave the slot back takes its files to a folder of its own
    (`set_aside`)."""

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

    def set_aside(self, name: str, a: Assignment) -> Workspace:
        """This run's trained result, output folder and round weights moved to a folder of their own (`name`, under
        the working folder), so that the worker's next assignment can use the working folder meanwhile: the
        result and outputs renamed, the weights linked (the next download replaces the file, not its bytes).
        The assignment is written beside them, so that a worker killed before it reported the run can report it
        failed when it starts again (`left_aside`). A shard's own state is not moved: no job that trains in a
        secure round keeps one."""
        aside = Workspace(self.work / ASIDE / name)
        shutil.rmtree(aside.job_dir, ignore_errors=True)  # left by a worker that stopped during such a run
        aside.work.mkdir(parents=True)
        written = aside.job_dir / f".{ASSIGNMENT}"
        written.write_text(a.model_dump_json())
        written.rename(aside.job_dir / ASSIGNMENT)  # whole or absent, whenever the worker is killed
        os.link(self.weights, aside.weights)
        self.result.rename(aside.result)
        if self.out_dir.is_dir():
            self.out_dir.rename(aside.out_dir)
        return aside

    def mark_reported(self) -> None:
        """A set-aside run's result is reported: its assignment goes, so a worker killed from now on has nothing to
        report for it."""
        (self.job_dir / ASSIGNMENT).unlink(missing_ok=True)

    def remove(self) -> None:
        """Remove the folder and everything in it (a set-aside run's, once it ended)."""
        shutil.rmtree(self.job_dir, ignore_errors=True)


@dataclass(frozen=True)
class LeftAside:
    """A set-aside run found when the worker starts: its last steps died with the worker that ran them."""

    space: Workspace
    # What to report failed; None where there is nothing to report: the run's result was reported before the
    # worker died, or the worker was killed as it set the run aside (its assignment absent or unreadable).
    assignment: Assignment | None


def left_aside(cache: Path) -> list[LeftAside]:
    """The set-aside runs in a worker's folder (`cache`): at its start, the ones its previous process left when it
    was killed (SIGKILL, out of memory) before their last steps ended."""
    found = []
    for folder in sorted(cache.glob(f"jobs/*/work/{ASIDE}/*")):
        try:
            a: Assignment | None = Assignment.model_validate_json((folder / ASSIGNMENT).read_text())
        except (OSError, ValueError):
            a = None
        found.append(LeftAside(Workspace(folder), a))
    return found
