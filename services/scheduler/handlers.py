"""What the scheduler does on each message: load the job, ask the pure decisions, store the outcome with
the events it causes (one transaction), then publish them."""

from __future__ import annotations

import logging
import time
import uuid
from typing import TypeAlias

from pydantic import ValidationError

from apiary import keys, telemetry
from apiary.bus import Bus, Delivery
from apiary.component import from_json
from apiary.contracts import (
    JobAccepted,
    JobCancelRequested,
    JobCompleted,
    JobFailed,
    JobRejected,
    JobRequested,
    JobSharded,
    JobWaiting,
    RoundAggregated,
    RoundFailed,
    RoundTimeout,
    ShardRequested,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
    decode_body,
)
from apiary.db import Database, Executor
from apiary.jobspec import FieldError, JobSpec, describe_errors, field_errors, strategy_errors
from apiary.outbox import KeyedLocks, Outbox, Pending
from apiary.settings import Settings
from apiary.status import JobStatus, RoundStatus
from apiary.storage import ObjectNotFound, Storage
from apiary.trainers import UserCodeError, UserCodeRunner
from apiary.weights import WeightsError
from services.scheduler import store
from services.scheduler.models import evaluate, final_report, finish_built_in, initial_weights
from services.scheduler.rounds import (
    RoundTarget,
    online_preferences,
    plan_round,
    round_start,
    url_lifetime,
    waiting_for_workers,
)
from services.scheduler.routing import AssignmentRouter
from services.scheduler.state import Next, after_aggregated, after_failed, is_current, too_many_failures
from services.scheduler.store import Job

log = logging.getLogger("apiary.scheduler")

# The events that say a worker is (or is no longer) online.
Presence: TypeAlias = WorkerOnline | WorkerHeartbeat | WorkerOffline


class SchedulerHandlers:
    """Runs each job's state machine; every transition is stored with the events it causes."""

    def __init__(self, db: Database, bus: Bus, storage: Storage, outbox: Outbox, runner: UserCodeRunner,
                 settings: Settings) -> None:
        self._db, self._storage, self._outbox, self._runner = db, storage, outbox, runner
        self._settings = settings
        self._router = AssignmentRouter(bus, storage)
        self._locks = KeyedLocks()

    # ------------------------------------------------------------ job.requested, job.cancel

    async def on_job_requested(self, delivery: Delivery) -> None:
        """Validate a job request; accept it and ask for shards, or reject it naming each bad field."""
        data = decode_body(delivery.body, delivery.content_type)
        raw_id = data.get("job_id")
        job_id = raw_id if isinstance(raw_id, str) and raw_id else uuid.uuid4().hex[:12]
        try:
            request = JobRequested.model_validate(data)
        except ValidationError as e:
            await self._reject(job_id, field_errors(e))
            return
        spec = JobSpec.model_validate(request.model_dump(exclude={"job_id", "v"}))
        if errors := strategy_errors(spec):
            await self._reject(job_id, errors)
            return
        async with self._locks(job_id):
            if await store.job_exists(self._db, job_id):
                log.info("job %s: duplicate request ignored", job_id)
                return
            now = time.time()
            cancel = await store.early_cancel(self._db, job_id)
            if cancel is not None:
                await self._accept_cancelled(job_id, spec, cancel, now)
                return
            async with self._db.transaction() as tx:
                await store.insert_job(tx, job_id, spec, JobStatus.SHARDING, now)
                await self._outbox.add(tx, _accepted(job_id, spec))
                await self._outbox.add(tx, ShardRequested(
                    job_id=job_id, dataset=spec.dataset, dataset_id=spec.dataset_id,
                    num_shards=spec.num_shards, strategy=spec.split.strategy, seed=spec.split.seed,
                    alpha=spec.split.alpha, group_key=spec.split.key,
                ))
        log.info("job %s (%s) accepted", job_id, spec.name)
        await self._outbox.flush()

    async def _reject(self, job_id: str, errors: list[FieldError]) -> None:
        """Reject a job request, naming each bad field."""
        reason = f"job request rejected: {describe_errors(errors)}"
        log.warning("job %s: %s", job_id, reason)
        async with self._db.transaction() as tx:
            await self._outbox.add(tx, JobRejected(job_id=job_id, reason=reason, errors=errors))
        await self._outbox.flush()

    async def _accept_cancelled(self, job_id: str, spec: JobSpec, reason: str, now: float) -> None:
        """A request whose cancel came first: recorded as a cancelled job that never ran."""
        async with self._db.transaction() as tx:
            await store.insert_job(tx, job_id, spec, JobStatus.CANCELLED, now, reason=reason)
            await store.forget_cancel(tx, job_id)
            await self._outbox.add(tx, _accepted(job_id, spec))
            await self._outbox.add(tx, JobFailed(job_id=job_id, reason=reason, round=0, cancelled=True))
        log.info("job %s (%s) cancelled before it started", job_id, spec.name)
        await self._outbox.flush()

    async def on_job_cancel(self, event: JobCancelRequested, delivery: Delivery) -> None:
        """Stop a job: no further round starts; results still in flight are ignored."""
        async with self._locks(event.job_id):
            job = await store.job(self._db, event.job_id)
            if job is None:
                # Its request has not arrived (or not been handled) yet: remembered for when it does.
                await store.remember_cancel(self._db, event.job_id, event.reason, time.time())
                log.info("job %s: cancel received before the job's request; it will not start", event.job_id)
                return
            if job.status.terminal:
                return
            async with self._db.transaction() as tx:
                await self._close_running_rounds(tx, event.job_id, RoundStatus.CANCELLED, event.reason)
                await store.end_job(tx, event.job_id, JobStatus.CANCELLED, event.reason, time.time())
                await self._outbox.add(tx, JobFailed(job_id=event.job_id, reason=event.reason, round=job.round,
                                                      cancelled=True))
        await self._outbox.flush()

    async def fail_unfinished(self, reason: str) -> list[str]:
        """End every job that has not ended as failed with `reason`; return their ids."""
        ended = []
        for job_id in await store.job_ids(self._db, unfinished=True):
            async with self._locks(job_id):
                job = await store.job(self._db, job_id)
                if job is None or job.status.terminal:
                    continue
                async with self._db.transaction() as tx:
                    await self._close_running_rounds(tx, job_id, RoundStatus.FAILED, reason)
                    await self._fail_tx(tx, job_id, reason, job.round)
                ended.append(job_id)
        await self._outbox.flush()
        return ended

    # ------------------------------------------------------------ job.sharded, worker presence

    async def on_job_sharded(self, event: JobSharded, delivery: Delivery) -> None:
        """Shards are ready: make the initial weights and start round 1."""
        async with self._locks(event.job_id):
            job = await store.job(self._db, event.job_id)
            if job is None or job.status != JobStatus.SHARDING:
                return
            spec = job.spec
            if event.error:
                await self._fail(event.job_id, event.error)
                return
            try:
                weights = await initial_weights(self._storage, self._runner, event.job_id, spec)
            except (UserCodeError, WeightsError, ObjectNotFound, OSError, ValueError) as e:
                await self._fail(event.job_id, f"initial weights: {e}")
                return
            async with self._db.transaction() as tx:
                await store.set_sharded(tx, event.job_id, event.shards, event.dataset_id, weights, time.time())
                await self._start_round(tx, RoundTarget(event.job_id, spec, event.shards, weights, 1, 1))
        await self._outbox.flush()

    async def on_worker_presence(self, event: Presence, delivery: Delivery) -> None:
        """Track which workers are online; start the rounds of jobs that were waiting for them."""
        online = not isinstance(event, WorkerOffline)
        await store.record_presence(self._db, event.worker_id, online, time.time())
        if not online:
            return
        for job_id in await store.job_ids(self._db, status=JobStatus.WAITING):
            async with self._locks(job_id):
                job = await store.job(self._db, job_id)
                if job is None or job.status != JobStatus.WAITING:
                    continue
                async with self._db.transaction() as tx:
                    await self._start_round(tx, _target(job, job.round, job.attempt))
            await self._outbox.flush()

    # ------------------------------------------------------------ round outcomes

    async def on_round_aggregated(self, event: RoundAggregated, delivery: Delivery) -> None:
        """A round's average is stored: start the next round, or finish the job."""
        async with self._locks(event.job_id):
            job = await self._current(event)
            if job is None:
                return
            spec = job.spec
            decision = after_aggregated(event.round, spec.distributed.num_rounds)
            if decision.next is Next.FINISH:
                await self._finish(job, spec, event)
                return
            target = RoundTarget(event.job_id, spec, job.shards, event.weights, decision.round, decision.attempt)
            async with self._db.transaction() as tx:
                await self._close_round(tx, event.job_id, event.round, event.attempt, RoundStatus.AGGREGATED,
                                        weights_key=event.weights.key, metrics=event.metrics)
                await store.set_global_weights(tx, event.job_id, event.weights, event.metrics)
                await self._start_round(tx, target, prefer=event.trained_by)
        await self._outbox.flush()

    async def on_round_failed(self, event: RoundFailed, delivery: Delivery) -> None:
        """A round failed: retry it from the last global weights, or fail the job."""
        async with self._locks(event.job_id):
            job = await self._current(event)
            if job is None:
                return
            tolerance = job.spec.distributed.fault_tolerance
            decision = after_failed(event.round, event.attempt, job.failures, tolerance)
            log.warning("job %s: round %d attempt %d failed: %s", event.job_id, event.round, event.attempt,
                        event.reason)
            async with self._db.transaction() as tx:
                await self._close_round(tx, event.job_id, event.round, event.attempt, RoundStatus.FAILED,
                                        reason=event.reason)
                if decision.next is Next.FAIL:
                    reason = too_many_failures(event.round, decision.failures, tolerance, event.reason)
                    await self._fail_tx(tx, event.job_id, reason, event.round)
                else:
                    await store.set_failures(tx, event.job_id, decision.failures)
                    await self._start_round(tx, _target(job, decision.round, decision.attempt))
        await self._outbox.flush()

    async def _finish(self, job: Job, spec: JobSpec, event: RoundAggregated) -> None:
        """The last round aggregated: store the final model and its report, and complete the job."""
        job_id = job.job_id
        final_key = keys.final_model(job_id)
        data = await self._storage.get_bytes(event.weights.key)
        await self._storage.put_bytes(final_key, data)
        evaluated, evaluation_error = await evaluate(self._runner, job_id, spec, event.round, data)
        evaluation_error = evaluation_error or await finish_built_in(self._storage, job_id, spec, data)
        metrics = {**event.metrics, **evaluated}
        history = await store.round_history(self._db, job_id)
        report = final_report(job_id, spec.name, metrics, history, event, evaluation_error)
        await self._storage.put_bytes(keys.final_metrics(job_id), report)
        final_uri = self._storage.uri(final_key)
        async with self._db.transaction() as tx:
            await self._close_round(tx, job_id, event.round, event.attempt, RoundStatus.AGGREGATED,
                                    weights_key=event.weights.key, metrics=event.metrics)
            await store.complete_job(tx, job_id, final_uri, metrics, event.weights, evaluation_error, time.time())
            await self._outbox.add(tx, JobCompleted(job_id=job_id, rounds_completed=event.round,
                                                    final_model=final_uri, metrics=metrics))
        log.info("job %s completed after %d rounds: %s", job_id, event.round, metrics)
        await self._outbox.flush()

    async def _current(self, event: RoundAggregated | RoundFailed) -> Job | None:
        """The running job, if the outcome is for the attempt it runs now (else it is late or a
        duplicate, and ignored)."""
        job = await store.job(self._db, event.job_id)
        if job is None or job.status != JobStatus.RUNNING:
            return None
        if not is_current(job.round, job.attempt, event.round, event.attempt):
            log.info("job %s: late %s for round %d attempt %d ignored", event.job_id, event.routing_key,
                     event.round, event.attempt)
            return None
        return job

    # ------------------------------------------------------------ starting and ending rounds

    async def _start_round(self, tx: Executor, target: RoundTarget, prefer: dict[int, str] | None = None) -> None:
        """Start the round if enough workers are online; else park the job as waiting, with why.
        `prefer` names the worker that trained each shard last round: it is offered the shard again."""
        spec = target.spec
        online = await store.online_workers(tx, time.time() - self._settings.worker_offline_after)
        waiting = waiting_for_workers(spec.distributed.min_workers, spec.worker_selection.pinned, online)
        if waiting is not None:
            await store.set_waiting(tx, target.job_id, target.round, target.attempt, waiting.reason, time.time())
            await self._outbox.add(tx, JobWaiting(job_id=target.job_id, reason=waiting.reason, round=target.round,
                                                  online=waiting.online, required=waiting.required))
            log.info("job %s: round %d %s", target.job_id, target.round, waiting.reason)
            return
        await store.end_waiting(tx, target.job_id)
        await self._launch_round(tx, target, online_preferences(prefer, online))

    async def _launch_round(self, tx: Executor, target: RoundTarget, prefer: dict[int, str]) -> None:
        """Store the round and queue round.start, one assignment per shard and the delayed timeout."""
        plan = plan_round(target.spec, target.shards, time.time())
        trace_ids = telemetry.new_round_ids()
        trace = telemetry.headers_for(telemetry.round_context(*trace_ids))
        await store.insert_round(tx, target.job_id, target.round, target.attempt, [s.index for s in plan.chosen],
                                 plan.started_at, plan.deadline, trace_ids)
        queued = [Pending(round_start(target, plan), headers=trace)]
        ttl = url_lifetime(plan, self._settings.presign_ttl)
        for assignment, routing_key in await self._router.assignments(target, plan, prefer, ttl):
            queued.append(Pending(assignment, routing_key=routing_key, headers=trace))
        queued.append(Pending(RoundTimeout(job_id=target.job_id, round=target.round, attempt=target.attempt),
                              delay=plan.timeout, headers=trace))
        await self._outbox.add_all(tx, queued)
        log.info("job %s: round %d/%d (attempt %d) started on %d shards", target.job_id, target.round,
                 target.spec.distributed.num_rounds, target.attempt, len(plan.chosen))

    async def _close_round(self, tx: Executor, job_id: str, round_index: int, attempt: int, status: RoundStatus,
                           *, reason: str | None = None, weights_key: str | None = None,
                           metrics: dict[str, float] | None = None) -> None:
        """End a round with `status`, recording its span (the root of the round's trace)."""
        row = await store.running_round(tx, job_id, round_index, attempt)
        if row is not None and row["trace_id"]:
            attributes = {"apiary.job_id": job_id, "apiary.round": round_index, "apiary.attempt": attempt,
                          "apiary.shards": len(from_json(row["shards"], [])), "apiary.round.status": str(status)}
            telemetry.recorded_span(f"round {round_index}", int(row["trace_id"], 16), int(row["span_id"], 16),
                                    int(row["started_at"] * 1e9), attributes, error=reason)
        await store.close_round(tx, job_id, round_index, attempt, status, time.time(), reason=reason,
                                weights_key=weights_key, metrics=metrics)

    async def _close_running_rounds(self, tx: Executor, job_id: str, status: RoundStatus, reason: str) -> None:
        """End the job's running round, if any, with `status`: the job ended before the round did."""
        for round_index, attempt in await store.running_rounds(tx, job_id):
            await self._close_round(tx, job_id, round_index, attempt, status, reason=reason)

    async def _fail(self, job_id: str, reason: str, round_index: int | None = None) -> None:
        """Fail the job for `reason` and publish why."""
        async with self._db.transaction() as tx:
            await self._fail_tx(tx, job_id, reason, round_index)
        await self._outbox.flush()

    async def _fail_tx(self, tx: Executor, job_id: str, reason: str, round_index: int | None) -> None:
        """Fail the job for `reason` in the caller's transaction."""
        log.error("job %s failed: %s", job_id, reason)
        await store.end_job(tx, job_id, JobStatus.FAILED, reason, time.time())
        await self._outbox.add(tx, JobFailed(job_id=job_id, reason=reason, round=round_index))


def _accepted(job_id: str, spec: JobSpec) -> JobAccepted:
    """The job.accepted event for a job."""
    return JobAccepted(job_id=job_id, name=spec.name, num_rounds=spec.distributed.num_rounds,
                       num_shards=spec.num_shards)


def _target(job: Job, round_index: int, attempt: int) -> RoundTarget:
    """A round of a stored job, from its current global weights."""
    return RoundTarget(job.job_id, job.spec, job.shards, job.weights, round_index, attempt)
