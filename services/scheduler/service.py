"""The scheduler component: its ports, its subscriptions, and a clean start and stop."""

from __future__ import annotations

from typing import Any

from apiary.bus import EventHandler, Raw
from apiary.component import Component
from apiary.contracts import AdapterMerged, WeightsInitialized, WorkerEvaluated
from apiary.outbox import Outbox
from services.scheduler import task_proofs
from services.scheduler.handlers import SchedulerHandlers
from services.scheduler.store import MIGRATIONS, OUTBOX


class Scheduler(Component):
    """Owns jobs and rounds: starts each round and moves a job to its end."""

    name = "scheduler"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbox = Outbox(self.db, self.bus, OUTBOX)
        # No user code runs here, nor is a base model loaded: a job's fl_init_weights and fl_evaluate_model,
        # a built-in job's base weights and its merged model are tasks for workers.
        self.handlers = SchedulerHandlers(self.db, self.bus, self.storage, self.outbox, self.settings)

    async def start(self) -> None:
        """Migrate, publish what an earlier run left in the outbox, and start consuming."""
        await self.db.migrate(self.name, MIGRATIONS)
        await self.db.migrate(task_proofs.COMPONENT, task_proofs.MIGRATIONS)
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
        }
        await self.consume("scheduler", handlers)

    async def stop(self) -> None:
        """Stop consuming, then the outbox's background flush."""
        await super().stop()
        await self.outbox.close()

    async def fail_unfinished(self, reason: str) -> list[str]:
        """End every job that has not ended as failed with `reason`; return their ids.

        For a bus that lives in one process (the embedded default): the messages of jobs that an earlier
        process left unfinished died with it, so nothing would ever move those jobs again.
        """
        return await self.handlers.fail_unfinished(reason)


__all__ = ["Scheduler"]
