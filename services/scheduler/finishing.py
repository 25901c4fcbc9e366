"""How a job ends once its rounds say so: completed after its last round and its evaluations, stopped early
(keeping the best round's model), or failed for an early-stopping metric no round reports."""

from __future__ import annotations

import logging
import time
from typing import Any

from apiary import keys
from apiary.contracts import JobCompleted
from apiary.db import Database
from apiary.outbox import Outbox
from apiary.status import RoundStatus
from apiary.storage import Storage
from services.scheduler import store
from services.scheduler.commands import JobEndings
from services.scheduler.evaluation import Ending, Evaluation, ending, final_metrics, judged_by_evaluation
from services.scheduler.models import final_report, finish_built_in
from services.scheduler.store import Job

log = logging.getLogger("apiary.scheduler")


class JobFinisher:
    """Decides, after each round's outcome or evaluation, whether the job ends now, and ends it."""

    def __init__(self, db: Database, storage: Storage, outbox: Outbox, endings: JobEndings) -> None:
        self._db, self._storage, self._outbox, self._endings = db, storage, outbox, endings

    async def settle(self, job_id: str) -> None:
        """End the job if its rounds and evaluations so far say it ends (the caller holds the job's lock)."""
        job = await store.job(self._db, job_id)
        if job is None or job.status.terminal:
            return
        spec = job.spec
        rounds = await store.aggregated_rounds(self._db, job_id)
        rows = await store.evaluations(self._db, job_id)
        evaluations = [Evaluation(r["round"], r["status"], r["metrics"], r["error"]) for r in rows]
        metrics = {index: r["metrics"] for index, r in rounds.items()}
        end = ending(spec, job.last_round, judged_by_evaluation(spec, job.evaluates), metrics, evaluations)
        if end is None:
            return
        if end.failure is not None:
            async with self._db.transaction() as tx:
                await self._endings.close_running_rounds(tx, job_id, RoundStatus.CANCELLED, end.failure)
                await self._endings.fail_tx(tx, job_id, end.failure, end.last)
            return
        await self._complete(job, end, rounds[end.kept]["weights_key"], final_metrics(end.kept, metrics, evaluations),
                             rows)

    async def _complete(self, job: Job, end: Ending, weights_key: str, metrics: dict[str, float],
                        evaluations: list[dict[str, Any]]) -> None:
        """Store the kept round's model as the final one, its report, and complete the job."""
        job_id, spec = job.job_id, job.spec
        final_key = keys.final_model(job_id)
        data = await self._storage.get_bytes(weights_key)
        final = await self._storage.put_bytes(final_key, data)
        reason = end.reason or await finish_built_in(self._storage, job_id, spec, data)
        history = await store.round_history(self._db, job_id)
        report = final_report(job_id, spec.name, metrics, history, evaluations, end.kept, reason)
        await self._storage.put_bytes(keys.final_metrics(job_id), report)
        final_uri = self._storage.uri(final_key)
        async with self._db.transaction() as tx:
            await self._endings.close_running_rounds(tx, job_id, RoundStatus.CANCELLED, reason or "job completed")
            await store.complete_job(tx, job_id, final_uri, metrics, final, reason, time.time())
            await self._outbox.add(tx, JobCompleted(
                job_id=job_id, rounds_completed=end.last, final_model=final_uri, metrics=metrics, reason=reason,
                best_round=end.kept if end.kept != end.last else None))
        log.info("job %s completed after %d rounds (model of round %d)%s: %s", job_id, end.last, end.kept,
                 f" ({reason})" if reason else "", metrics)
