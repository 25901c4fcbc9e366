"""The scheduler component: its ports, its subscriptions, and a clean start and stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from apiary import metrics
from apiary.bus import EventHandler, Raw
from apiary.component import Component
from apiary.contracts import AdapterMerged, WeightsInitialized, WorkerDone, WorkerEvaluated, WorkerFailed
from apiary.outbox import Outbox
from services.scheduler import gauges, shard_evaluations, shard_states, task_proofs
from services.scheduler.handlers import SchedulerHandlers
from services.scheduler.store import MIGRATIONS, OUTBOX

log = logging.getLogger("apiary.scheduler")


class Scheduler(Component):
    """Owns jobs and rounds: starts each round and moves a job to its end."""

    name = "scheduler"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbox = Outbox(self.db, self.bus, OUTBOX)
        # No user code runs here, nor is a base model loaded: a job's fl_init_weights and fl_evaluate_model,
        # a built-in job's base weights and its merged model are tasks for workers.
        self.handlers = SchedulerHandlers(self.db, self.bus, self.storage, self.outbox, self.settings)
        self._pacer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Migrate, publish what an earlier run left in the outbox, and start consuming."""
        await self.db.migrate(self.name, MIGRATIONS)
        await self.db.migrate(task_proofs.COMPONENT, task_proofs.MIGRATIONS)
        await self.db.migrate(shard_states.COMPONENT, shard_states.MIGRATIONS)
        await self.db.migrate(shard_evaluations.COMPONENT, shard_evaluations.MIGRATIONS)
        await self.handlers.versions.migrate()
        await self.outbox.flush()
        h = self.handlers
        handlers: dict[str, EventHandler | Raw] = {
            "job.requested": Raw(h.on_job_requested),
            "job.sharded": h.on_job_sharded,
            "round.aggregated": h.on_round_aggregated,
            "round.failed": h.on_round_failed,
            WeightsInitialized.routing_key: h.on_job_initialized,
            WorkerEvaluated.routing_key: h.on_worker_evaluated,
            AdapterMerged.routing_key: h.on_adapter_merged,
            "task.timeout": h.on_task_timeout,
            "job.cancel": h.on_job_cancel,
            "worker.online": h.on_worker_presence,
            "worker.heartbeat": h.on_worker_presence,
            "worker.offline": h.on_worker_presence,
            # Mode async's task reports only: a synchronous round's reports go to the aggregator alone.
            WorkerDone.async_routing_key: h.on_worker_report,
            WorkerFailed.async_routing_key: h.on_worker_report,
        }
        await self.consume("scheduler", handlers)
        self._pacer = asyncio.create_task(self._pace(), name="scheduler:presence-pace")

    async def stop(self) -> None:
        """Stop consuming and pacing, then the outbox's background flush."""
        if self._pacer is not None:
            self._pacer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pacer
            self._pacer = None
        await super().stop()
        await self.outbox.close()

    async def _pace(self) -> None:
        """Every heartbeat interval (at least a second), count the fleet and announce its pace if it changed; and,
        while metrics are on, sample the operational gauges (services.scheduler.gauges)."""
        every = max(1.0, self.settings.heartbeat_interval)
        while True:
            try:
                await self.handlers.check_pace()
                if metrics.enabled():
                    await gauges.sample(self.db, self.bus, self.handlers.online_since())
            except Exception as e:  # the database or the broker is away: the next check tries again
                log.warning("presence pace (or gauges) not checked: %s", e)
            await asyncio.sleep(every)

    async def fail_unfinished(self, reason: str) -> list[str]:
        """End every job that has not ended as failed with `reason`; return their ids.

        For a bus that lives in one process (the embedded default): the messages of jobs that an earlier
        process left unfinished died with it, so nothing would ever move those jobs again.
        """
        return await self.handlers.fail_unfinished(reason)


__all__ = ["Scheduler"]
