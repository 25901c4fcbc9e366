"""`apiary run`'s embedded stack: every service and N workers in one process, on the settings' ports."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

from apiary.bus import Bus
from apiary.bus.identity import worker_user
from apiary.bus.memory import MemoryBus
from apiary.component import Component
from apiary.settings import Settings
from apiary.status import TERMINAL
from services.app import dblock
from services.app.dblock import DatabaseInUse
from services.app.ports import Ports
from services.tracker.client import JobNotFound, TrackerClient, TrackerError
from services.tracker.inprocess import in_process_client
from services.tracker.publish import publish_job_request

log = logging.getLogger("apiary.runtime")

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
        # Workers take the given GPUs in turn (several share one where there are more workers than GPUs), and
        # share one model cache: a base model is downloaded (and a GGUF file converted) once, not once each.
        shared = {"model_cache": self.settings.model_cache or self.settings.home / "models"}
        self.workers = [
            Worker(self._worker_bus(f"worker-{i + 1}"),
                   self.settings.model_copy(update={**shared, **({"gpu": gpus[i % len(gpus)]} if gpus else {})}),
                   worker_id=f"worker-{i + 1}")
            for i in range(workers)
        ]
        self._lock_fd: int | None = None
        # The stack's own client of its tracker's API, served in-process (no port, no socket).
        self.api: TrackerClient = in_process_client(self.tracker)
        self._token: str | None = None

    async def __aenter__(self) -> Embedded:
        self._lock_fd = dblock.take(self.settings)
        owns_database = self._lock_fd is not None
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

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self.api.aclose()
        with contextlib.suppress(Exception):
            await self._drop_token()
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

    def _worker_bus(self, worker_id: str) -> Bus:
        """The bus a worker publishes on: on the in-memory bus, as that worker's broker user (as on RabbitMQ with
        `apiary broker setup`), so its messages carry its user id."""
        bus = self.ports.bus
        return bus.as_user(worker_user(worker_id)) if isinstance(bus, MemoryBus) else bus

    async def api_token(self) -> str:
        """An admin token of this run's HTTP API (made once, revoked when the stack stops), also left in
        `APIARY_HOME/token` (mode 0600) for the CLI's commands while the run lasts."""
        if self._token is None:
            from services.app.tokens import write_run_token
            from services.tracker import token_store

            await token_store.migrate(self.ports.db)
            self._token = await token_store.create(self.ports.db, f"apiary-run-{uuid.uuid4().hex[:8]}", "admin")
            write_run_token(self.settings.home, self._token)
        return self._token

    async def _drop_token(self) -> None:
        from services.app.tokens import remove_run_token
        from services.tracker import token_store

        token, self._token = self._token, None
        if token is None:
            return
        remove_run_token(self.settings.home, token)
        principal = await token_store.principal(self.ports.db, token)
        if principal is not None:
            await token_store.revoke(self.ports.db, principal.name)

    async def submit(self, request: dict[str, Any]) -> str:
        """Publish a job request as another system would; return its job id."""
        return await publish_job_request(self.ports.bus, request)

    async def cancel(self, job_id: str, reason: str, *, within: float = 10.0) -> dict[str, Any] | None:
        """Cancel a job and wait up to `within` seconds for it to end; return its view."""
        try:
            await self.api.cancel_job(job_id, reason, ahead=True)
        except TrackerError as e:
            if e.status_code != 409:  # 409: it already ended
                raise
        with contextlib.suppress(TimeoutError):
            return await self.wait(job_id, timeout=within)
        with contextlib.suppress(JobNotFound):
            return await self.api.get_job(job_id)
        return None

    async def wait(self, job_id: str, *, timeout: float | None = None, on_change: Any = None,
                   until: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        """Wait until the job ends (or its view satisfies `until`); call `on_change(view)` whenever the
        tracker's view of it changes. Follows the job through the tracker's API, in-process."""
        try:
            async with asyncio.timeout(timeout):
                return await self._follow(job_id, on_change, until)
        except TimeoutError:
            raise TimeoutError(f"job {job_id} did not finish within {timeout}s") from None

    async def _follow(self, job_id: str, on_change: Any, until: Callable[[dict[str, Any]], bool] | None
                      ) -> dict[str, Any]:
        async with aclosing(self.api.watch_job(job_id, wait_known=True)) as views:
            async for view in views:
                if on_change is not None:
                    on_change(view)
                if view["status"] in TERMINAL or (until is not None and until(view)):
                    return view
        raise RuntimeError(f"the tracker stopped before job {job_id} ended")


__all__ = ["ORPHANED", "DatabaseInUse", "Embedded", "Ports"]
