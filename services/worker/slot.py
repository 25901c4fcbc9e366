"""The worker's one training slot: one assignment at a time, what it runs now, and what its trained shards
measured (the throughput its heartbeats and progress report)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from apiary.contracts import TRAIN, Assignment

IDLE = "idle"


class Slot:
    """One assignment at a time: whoever holds `held()` runs it; the slot says what runs, and stops it when its
    job ends."""

    def __init__(self) -> None:
        self._held = asyncio.Lock()
        self._running: asyncio.Task[float | None] | None = None
        self.current: Assignment | None = None
        self.state = IDLE  # what heartbeats say: idle, training, or the task an init/evaluate/merge runs
        self.samples_per_s: float | None = None  # as the latest trained shard measured it
        self.completed = 0  # trained shards reported

    @property
    def busy(self) -> bool:
        """Whether an assignment holds the slot (runs, or is about to)."""
        return self._held.locked()

    def held(self) -> asyncio.Lock:
        """The slot's lock: an assignment runs while its queue's turn holds it (`async with slot.held()`)."""
        return self._held

    async def run(self, assignment: Assignment, work: Coroutine[Any, Any, float | None], name: str) -> bool:
        """Run the assignment's `work` in its own task (so that its job ending can stop it, `stop`); False if
        that stopped it. A trained shard's report returns its samples per second, recorded here."""
        # An init or evaluate task names no shard: heartbeats say which task, not that a shard trains.
        self.current, self.state = assignment, "training" if assignment.task == TRAIN else assignment.task
        try:
            self._running = asyncio.create_task(work, name=name)
            try:
                rate = await self._running
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the worker is stopping: the assignment goes back to its queue
                return False
            if rate is not None:
                self.samples_per_s = rate
                self.completed += 1
            return True
        finally:
            self._running = None
            self.current, self.state = None, IDLE

    def stop(self, job_id: str) -> Assignment | None:
        """Stop the assignment running now if it is of `job_id` (its training child is killed); which it was."""
        a, running = self.current, self._running
        if a is None or a.job_id != job_id or running is None or running.done():
            return None
        running.cancel()
        return a
