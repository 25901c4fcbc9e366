"""What the scheduler does on each round's messages (shards ready, workers online, a round aggregated or
failed): load the job, ask the pure decisions, store the outcome with the events it causes (one
transaction), then publish them. A job's commands (request, cancel) are in `commands`."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeAlias, TypeVar

from apiary import keys, telemetry
from apiary.bus import Bus, Delivery
from apiary.component import from_json
from apiary.contracts import (
    JobCompleted,
    JobFailed,
    JobSharded,
    JobWaiting,
    RoundAggregated,
    RoundFailed,
    RoundTimeout,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
)
from apiary.db import Database, Executor
from apiary.jobspec import JobSpec
from apiary.outbox import KeyedLocks, Outbox, Pending
from apiary.settings import Settings
from apiary.status import JobStatus, RoundStatus
from apiary.storage import ObjectNotFound, Storage
from apiary.trainers import UserCodeError, UserCodeRunner
from apiary.weights import WeightsError
from services.scheduler import store
from services.scheduler.commands import JobCommands
from services.scheduler.models import evaluate, final_report, finish_built_in, initial_weights
from services.scheduler.rounds import (
    RoundTarget,
    online_preferences,
    plan_round,
    round_start,
    url_lifetime,
    usable_workers,
    waiting_for_workers,
)
from services.scheduler.routing import AssignmentRouter
from services.scheduler.state import Next, after_aggregated, after_failed, is_current, too_many_failures
from services.scheduler.store import Job

log = logging.getLogger("apiary.scheduler")

# The events that say a worker is (or is no longer) online.
Presence: TypeAlias = WorkerOnline | WorkerHeartbeat | WorkerOffline
# A round's outcome, handled only if it is for the attempt its job runs now.
Outcome = TypeVar("Outcome", RoundAggregated, RoundFailed)


class SchedulerHandlers:
    """Runs each job's state machine; every transition is stored with the events it causes."""

    def __init__(self, db: Database, bus: Bus, storage: Storage, outbox: Outbox, runner: UserCodeRunner,
                 settings: Settings) -> None:
        self._db, self._storage, self._outbox, self._runner = db, storage, outbox, runner
        self._settings = settings
        self._router = AssignmentRouter(bus, storage)
        self._locks = KeyedLocks()
        # A job's commands are handled in their own module, under the same per-job locks; the Scheduler
        # subscribes to them through this object.
        commands = JobCommands(db, storage, outbox, self._locks, endings=self)
        self.on_job_requested = commands.on_job_requested
        self.on_job_cancel = commands.on_job_cancel
        self.fail_unfinished = commands.fail_unfinished

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
        kind = None if isinstance(event, WorkerOffline) else event.kind
        await store.record_presence(self._db, event.worker_id, online, time.time(), kind)
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
        await self._on_current(event, self._after_aggregated)

    async def _after_aggregated(self, job: Job, event: RoundAggregated) -> None:
        """Close the round and start the next one, or finish the job after its last."""
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

    async def on_round_failed(self, event: RoundFailed, delivery: Delivery) -> None:
        """A round failed: retry it from the last global weights, or fail the job."""
        await self._on_current(event, self._after_failed)

    async def _after_failed(self, job: Job, event: RoundFailed) -> None:
        """Close the round and start it again, or fail the job past its fault tolerance."""
        tolerance = job.spec.distributed.fault_tolerance
        decision = after_failed(event.round, event.attempt, job.failures, tolerance)
        log.warning("job %s: round %d attempt %d failed: %s", event.job_id, event.round, event.attempt,
                    event.reason)
        async with self._db.transaction() as tx:
            await self._close_round(tx, event.job_id, event.round, event.attempt, RoundStatus.FAILED,
                                    reason=event.reason)
            if decision.next is Next.FAIL:
                reason = too_many_failures(event.round, decision.failures, tolerance, event.reason)
                await self.fail_tx(tx, event.job_id, reason, event.round)
            else:
                await store.set_failures(tx, event.job_id, decision.failures)
                await self._start_round(tx, _target(job, decision.round, decision.attempt))

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

    async def _on_current(self, event: Outcome, act: Callable[[Job, Outcome], Awaitable[None]]) -> None:
        """Under the job's lock, `act` on the running job if the outcome is for the attempt it runs now
        (else it is late or a duplicate, and ignored); then publish what it stored."""
        async with self._locks(event.job_id):
            job = await store.job(self._db, event.job_id)
            if job is None or job.status != JobStatus.RUNNING:
                return
            if not is_current(job.round, job.attempt, event.round, event.attempt):
                log.info("job %s: late %s for round %d attempt %d ignored", event.job_id, event.routing_key,
                         event.round, event.attempt)
                return
            await act(job, event)
        await self._outbox.flush()

    # ------------------------------------------------------------ starting and ending rounds

    async def _start_round(self, tx: Executor, target: RoundTarget, prefer: dict[int, str] | None = None) -> None:
        """Start the round if enough workers are online; else park the job as waiting, with why.
        `prefer` names the worker that trained each shard last round: it is offered the shard again."""
        spec = target.spec
        seen = await store.online_workers(tx, time.time() - self._settings.worker_offline_after)
        online, wrong = usable_workers(seen, spec.worker_selection.kinds)
        waiting = waiting_for_workers(spec.distributed.min_workers, spec.worker_selection.pinned, online, wrong)
        if waiting is not None:
            await store.set_waiting(tx, target.job_id, target.round, target.attempt, waiting.reason, time.time())
            await self._outbox.add(tx, JobWaiting(job_id=target.job_id, reason=waiting.reason, round=target.round,
                                                  online=waiting.online, required=waiting.required))
            log.info("job %s: round %d %s", target.job_id, target.round, waiting.reason)
            return
        await store.end_waiting(tx, target.job_id)
        for reason in wrong.values():
            log.warning("job %s: round %d: %s: its shard gets no assignment", target.job_id, target.round, reason)
        await self._launch_round(tx, target, online_preferences(prefer, online), absent=set(wrong))

    async def _launch_round(self, tx: Executor, target: RoundTarget, prefer: dict[int, str],
                            absent: set[str] | None = None) -> None:
        """Store the round and queue round.start, one assignment per shard (none for a shard listed on an
        `absent` worker: the round's timeout finds it missing) and the delayed timeout."""
        plan = plan_round(target.spec, target.shards, time.time())
        trace_ids = telemetry.new_round_ids()
        trace = telemetry.headers_for(telemetry.round_context(*trace_ids))
        await store.insert_round(tx, target.job_id, target.round, target.attempt, [s.index for s in plan.chosen],
                                 plan.started_at, plan.deadline, trace_ids)
        queued = [Pending(round_start(target, plan), headers=trace)]
        ttl = url_lifetime(plan, self._settings.presign_ttl)
        for assignment, routing_key in await self._router.assignments(target, plan, prefer, ttl):
            if assignment.pinned_worker in (absent or ()):
                continue
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

    async def close_running_rounds(self, tx: Executor, job_id: str, status: RoundStatus, reason: str) -> None:
        """End the job's running round, if any, with `status`: the job ended before the round did."""
        for round_index, attempt in await store.running_rounds(tx, job_id):
            await self._close_round(tx, job_id, round_index, attempt, status, reason=reason)

    async def _fail(self, job_id: str, reason: str, round_index: int | None = None) -> None:
        """Fail the job for `reason` and publish why."""
        async with self._db.transaction() as tx:
            await self.fail_tx(tx, job_id, reason, round_index)
        await self._outbox.flush()

    async def fail_tx(self, tx: Executor, job_id: str, reason: str, round_index: int | None) -> None:
        """Fail the job for `reason` in the caller's transaction."""
        log.error("job %s failed: %s", job_id, reason)
        await store.end_job(tx, job_id, JobStatus.FAILED, reason, time.time())
        await self._outbox.add(tx, JobFailed(job_id=job_id, reason=reason, round=round_index))


def _target(job: Job, round_index: int, attempt: int) -> RoundTarget:
    """A round of a stored job, from its current global weights."""
    return RoundTarget(job.job_id, job.spec, job.shards, job.weights, round_index, attempt)
