"""The progress stream: the user's `logger.log_metrics` calls as throttled worker.progress events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from apiary import proof
from apiary.bus import Bus, publish_event
from apiary.contracts import Assignment, WorkerProgress


class ProgressStream:
    """Sends the latest metrics of one assignment at most once per `interval` seconds."""

    def __init__(self, bus: Bus, worker_id: str, assignment: Assignment, *, interval: float,
                 rate: Callable[[], float | None]) -> None:
        self._bus, self._worker_id, self._a = bus, worker_id, assignment
        self._interval = interval
        self._rate = rate  # the worker's samples per second, as it stands when a record is sent
        self._latest: dict[str, Any] | None = None
        self._last_sent = 0.0
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, record: dict[str, Any]) -> None:
        """Take a record (`step`, `metrics`); send it now unless one went out within the interval."""
        self._latest = record
        now = time.monotonic()
        if now - self._last_sent >= self._interval:
            self._send()

    def _send(self) -> None:
        if self._latest is None:
            return
        record, self._latest = self._latest, None
        self._last_sent = time.monotonic()
        a = self._a
        event = WorkerProgress(job_id=a.job_id, round=a.round, attempt=a.attempt, worker_id=self._worker_id,
                               shard=a.shard, metrics=record["metrics"], step=record["step"],
                               samples_per_s=self._rate(),
                               token=proof.progress_token(a.secret) if a.secret else "")
        task = asyncio.get_running_loop().create_task(publish_event(self._bus, event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Send the last unsent record and wait for every publish."""
        self._send()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
