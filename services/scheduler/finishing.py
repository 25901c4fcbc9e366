"""How a job ends once its rounds say so: completed after its last round and its evaluations (a built-in job
with merge_adapter once a worker has merged its final adapter into the base model), stopped early (keeping the
best round's model), or failed: for an early-stopping metric no round reports, or a merge that failed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from apiary import keys
from apiary.contracts import AdapterMerged, JobCompleted, ObjectRef
from apiary.db import Database
from apiary.outbox import Outbox
from apiary.status import RoundStatus
from apiary.storage import ObjectNotFound, Storage
from services.scheduler import endings, shard_states, store, task_proofs
from services.scheduler.builtin import FINAL_ADAPTER, final_folder, merge_due, store_merged
from services.scheduler.evaluation import Ending, Evaluation, ending, final_metrics, judged_by_evaluation
from services.scheduler.initial_and_final import final_report, finish_built_in
from services.scheduler.store import Job
from services.scheduler.task_assignments import TaskQueue

log = logging.getLogger("apiary.scheduler")


@dataclass(frozen=True)
class Verdict:
    """The job ends now: how (`end`), the kept round's weights, its final metrics and the evaluations' rows."""

    end: Ending
    weights_key: str
    metrics: dict[str, Any]
    evaluations: list[dict[str, Any]]


class JobFinisher:
    """Decides, after each round's outcome or evaluation, whether the job ends now, and ends it."""

    def __init__(self, db: Database, storage: Storage, outbox: Outbox, tasks: TaskQueue,
                 offline_after: Callable[[float], float]) -> None:
        self._db, self._storage, self._outbox = db, storage, outbox
        self._tasks, self._offline_after = tasks, offline_after

    async def settle(self, job_id: str) -> None:
        """End the job if its rounds and evaluations so far say it ends, or first ask a worker to merge its
        adapter (the caller holds the job's lock and publishes what this stored)."""
        job = await store.job(self._db, job_id)
        if job is None or job.status.terminal or job.merging is not None:
            return  # a job whose adapter is being merged ends when the merged model is in
        verdict = await self._verdict(job)
        if verdict is None:
            return
        end = verdict.end
        if end.failure is not None:
            async with self._db.transaction() as tx:
                await endings.close_running_rounds(tx, job_id, RoundStatus.CANCELLED, end.failure)
                await endings.fail_job(tx, self._outbox, job_id, end.failure, end.last)
            return
        final, data = await self._final_model(job_id, verdict.weights_key)
        artifacts = await finish_built_in(self._storage, job_id, job.spec, data)
        if artifacts is None and merge_due(job.spec):
            await self._queue_merge(job, end.kept, final)
            return
        await self._complete(job, verdict, final, end.reason or artifacts)

    async def on_merged(self, event: AdapterMerged) -> None:
        """A worker merged the job's final adapter: the merged model is stored under `final/merged/` and the job
        completes; a failed merge fails it, keeping the adapter folder (the caller holds the job's lock)."""
        job = await store.job(self._db, event.job_id)
        if job is None or job.status.terminal or job.merging != event.round:
            return  # ended, or a report of a merge this job is not waiting for (a duplicate)
        if event.error or event.merged is None:
            await self._merge_failed(job, f"failed on worker {event.worker_id}: {event.error or 'no model reported'}")
            return
        try:
            stored = await store_merged(self._storage, job.job_id, event.merged)
        except (ObjectNotFound, OSError, ValueError) as e:
            await self._merge_failed(job, f"worker {event.worker_id}'s upload is refused: {e}")
            return
        verdict = await self._verdict(job)
        if verdict is None:  # its rounds ended it when the merge was asked for; they have not changed since
            raise RuntimeError(f"job {job.job_id} was merging round {job.merging}'s adapter but has not ended")
        log.info("job %s: merged model at %s (by worker %s)", job.job_id, stored, event.worker_id)
        final, _ = await self._final_model(job.job_id, verdict.weights_key)
        await self._complete(job, verdict, final, verdict.end.reason)

    async def merge_timed_out(self, job: Job, round_index: int, timeout: float) -> None:
        """A merge assignment's time is up: the job fails, unless the merged model came in (or it is another's)."""
        if job.merging == round_index:
            await self._merge_failed(job, f"no worker did it within {timeout:.0f}s")

    async def _verdict(self, job: Job) -> Verdict | None:
        """How the job ends now, from its rounds and evaluations so far; None while it goes on."""
        spec = job.spec
        rounds = await store.aggregated_rounds(self._db, job.job_id)
        rows = await store.evaluations(self._db, job.job_id)
        evaluations = [Evaluation(r["round"], r["status"], r["metrics"], r["error"]) for r in rows]
        metrics = {index: r["metrics"] for index, r in rounds.items()}
        end = ending(spec, job.last_round, judged_by_evaluation(spec, job.evaluates), metrics, evaluations)
        if end is None:
            return None
        kept = rounds.get(end.kept)
        return Verdict(end, kept["weights_key"] if kept else "", final_metrics(end.kept, metrics, evaluations), rows)

    async def _final_model(self, job_id: str, weights_key: str) -> tuple[ObjectRef, bytes]:
        """The kept round's weights stored as the job's final model; its claim and bytes."""
        data = await self._storage.get_bytes(weights_key)
        return await self._storage.put_bytes(keys.final_model(job_id), data), data

    async def _queue_merge(self, job: Job, round_index: int, adapter: ObjectRef) -> None:
        """Ask a worker to merge the final adapter into the base model (it loads there, never here)."""
        now = time.time()
        async with self._db.transaction() as tx:
            online = set(await store.online_workers(tx, now - self._offline_after(now)))
            await store.set_merging(tx, job.job_id, round_index)
            queued = await self._tasks.merge(job.job_id, job.spec, round_index, adapter, online, now)
            await task_proofs.remember(tx, queued)
            await self._outbox.add_all(tx, queued)
        log.info("job %s: merging round %d's adapter into the base model, asked of a worker", job.job_id,
                 round_index)

    async def _merge_failed(self, job: Job, why: str) -> None:
        """Fail the job for its merge, in one line that says where its adapter is kept."""
        adapter = self._storage.uri(final_folder(job.job_id, FINAL_ADAPTER).rstrip("/"))
        reason = f"merging round {job.merging}'s adapter into the base model: {why} (the adapter is kept at {adapter})"
        async with self._db.transaction() as tx:
            await endings.fail_job(tx, self._outbox, job.job_id, reason, job.last_round)

    async def _complete(self, job: Job, verdict: Verdict, final: ObjectRef, reason: str | None) -> None:
        """Store the job's report and complete it, its final model being `final`."""
        job_id, end = job.job_id, verdict.end
        history = await store.round_history(self._db, job_id)
        report = final_report(job_id, job.spec.name, verdict.metrics, history, verdict.evaluations, end.kept, reason)
        await self._storage.put_bytes(keys.final_metrics(job_id), report)
        await shard_states.keep_final(self._storage, self._db, job_id, end.kept)
        if not job.spec.distributed.transfer.keep_contributions:
            # Kept beside the final model now: the states no round needs any more go (those of pending evaluations).
            await shard_states.prune(self._storage, self._db, job_id, end.last, {end.kept})
        final_uri = self._storage.uri(final.key)
        async with self._db.transaction() as tx:
            await endings.close_running_rounds(tx, job_id, RoundStatus.CANCELLED, reason or "job completed")
            await store.complete_job(tx, job_id, final_uri, verdict.metrics, final, reason, time.time())
            await self._outbox.add(tx, JobCompleted(
                job_id=job_id, rounds_completed=end.last, final_model=final_uri, metrics=verdict.metrics,
                reason=reason, best_round=end.kept if end.kept != end.last else None))
        log.info("job %s completed after %d rounds (model of round %d)%s: %s", job_id, end.last, end.kept,
                 f" ({reason})" if reason else "", verdict.metrics)
