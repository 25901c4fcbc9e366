"""The worker's one training slot: one assignment at a time, what it runs now, and what its trained shards
measured (the throughput its heartbeats and progress report); and the last steps of assignments that gave the
slot back before they ended (`HandedOff`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from apiary.contracts import TRAIN, Assignment

log = logging.getLogger("apiary.worker")

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


class HandedOff:
    """Assignments' last steps that go on without the slot (a secure shard, trained, waiting for its round's key
    agreement while the worker trains its next shard): each in its own task, stopped when its job ends or the
    worker stops. Their assignments are done with on the queue (acked): one stopped here is not trained again."""

    def __init__(self) -> None:
        self._running: dict[asyncio.Task[None], Assignment] = {}

    def start(self, a: Assignment, steps: Coroutine[Any, Any, None], name: str) -> None:
        """Run the assignment's `steps` in a task of their own."""
        task = asyncio.create_task(steps, name=name)
        self._running[task] = a
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        a = self._running.pop(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("job %s round %d shard %d: its steps after training ended in an error: %r", a.job_id, a.round,
                      a.shard, error)

    def __len__(self) -> int:
        return len(self._running)

    def held(self) -> list[Assignment]:
        """The assignments whose steps run now."""
        return list(self._running.values())

    def stop(self, job_id: str) -> list[Assignment]:
        """Stop the steps of `job_id`'s assignments; which they were."""
        stopped = [(task, a) for task, a in self._running.items() if a.job_id == job_id]
        for task, _ in stopped:
            task.cancel()
        return [a for _, a in stopped]

    async def cancel(self) -> None:
        """Stop every one, and wait until they have stopped (the worker stops)."""
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
