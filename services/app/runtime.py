"""`apiary run`'s embedded stack: every service and N workers in one process, on the settings' ports."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from apiary.bus import publish_event
from apiary.component import Component
from apiary.db import sqlite_path
from apiary.settings import Settings
from apiary.status import TERMINAL
from services.app.ports import Ports
from services.tracker.publish import publish_job_request

log = logging.getLogger("apiary.runtime")


class DatabaseInUse(RuntimeError):
    """Another embedded process runs on this database."""

ORPHANED = ("interrupted: the process that ran this job (apiary run) stopped before the job ended, and its"
            " in-memory messages went with it; run the job again")


class Embedded:
    """Every service and N workers in one process, on the settings' ports (in-memory bus by default)."""

    def __init__(self, settings: Settings, workers: int = 3, code_paths: list[str] | None = None,
                 gpus: list[int] | None = None) -> None:
        from services.aggregator import Aggregator
        from services.scheduler import Scheduler
        from services.sharder import Sharder
        from services.tracker import Tracker
        from services.worker import Worker

        self.settings = settings.model_copy(update={"code_path": [*settings.code_path, *(code_paths or [])]})
        self.ports = Ports(self.settings)
        args = (self.ports.bus, self.ports.db, self.ports.storage, self.settings)
        self.tracker = Tracker(*args)
        self.scheduler = Scheduler(*args)
        self.aggregator = Aggregator(*args)
        self.services: list[Component] = [self.tracker, Sharder(*args), self.aggregator, self.scheduler]
        # Workers take the given GPUs in turn (several share one where there are more workers than GPUs).
        self.workers = [
            Worker(self.ports.bus, self.settings.model_copy(update={"gpu": gpus[i % len(gpus)]}) if gpus
                   else self.settings, worker_id=f"worker-{i + 1}")
            for i in range(workers)
        ]
        self._lock_fd: int | None = None

    async def __aenter__(self) -> Embedded:
        owns_database = self._lock_database()
        try:
            await self.ports.open()
            for service in self.services:
                await service.start()
            if owns_database:
                # Jobs an earlier process left unfinished here: their messages died with it, so nothing
                # would ever move them again.
                for job_id in await self.scheduler.fail_unfinished(ORPHANED):
                    log.warning("job %s was left unfinished by an earlier process: marked failed", job_id)
            await asyncio.gather(*(w.start() for w in self.workers))
        except BaseException:
            with contextlib.suppress(Exception):
                await self.__aexit__()
            raise
        return self

    def _lock_database(self) -> bool:
        """With the in-memory bus on a SQLite file, hold that file alone while the stack runs.

        Two such processes on one database would each publish the other's stored events on its own bus
        (the outboxes are tables) and resume the other's jobs; so the second one is refused. Returns
        whether this stack holds the lock.
        """
        database = self.settings.resolved_database_url()
        if not (self.settings.bus_url.startswith("memory:") and database.startswith("sqlite:")):
            return False
        file = sqlite_path(database)
        if not file or ":memory:" in file:
            return False
        path = Path(file).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DatabaseInUse(
                f"another apiary process is running on {path}: wait for it to end, or give this run its"
                " own APIARY_HOME") from None
        self._lock_fd = fd
        return True

    async def __aexit__(self, *exc: object) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                await worker.stop()
        for service in reversed(self.services):
            with contextlib.suppress(Exception):
                await service.stop()
        await self.ports.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def submit(self, request: dict[str, Any]) -> str:
        """Publish a job request as another system would; return its job id."""
        return await publish_job_request(self.ports.bus, request)

    async def cancel(self, job_id: str, reason: str, *, within: float = 10.0) -> dict[str, Any] | None:
        """Cancel a job and wait up to `within` seconds for it to end; return its view."""
        from apiary.contracts import JobCancelRequested
        from services.tracker.views import job_view

        await publish_event(self.ports.bus, JobCancelRequested(job_id=job_id, reason=reason))
        with contextlib.suppress(TimeoutError):
            return await self.wait(job_id, timeout=within)
        return await job_view(self.ports.db, job_id)

    async def wait(self, job_id: str, *, timeout: float | None = None, on_change: Any = None,
                   until: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        """Wait until the job ends (or its view satisfies `until`); call `on_change(view)` whenever the
        tracker's view of it changes."""
        from services.tracker.views import job_view

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            view = await job_view(self.ports.db, job_id)
            if view is not None and on_change is not None:
                on_change(view)
            if view is not None and (view["status"] in TERMINAL or (until is not None and until(view))):
                return view
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} did not finish within {timeout}s")
            async with self.tracker.changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.tracker.changed.wait(), 1.0)


__all__ = ["ORPHANED", "DatabaseInUse", "Embedded", "Ports"]
