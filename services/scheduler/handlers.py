"""What the scheduler does on each round's messages (shards ready, workers online, a round aggregated or
failed): load the job, ask the pure decisions, store the outcome with the events it causes (one
transaction), then publish them. A job's commands (request, cancel) are in `commands`, how it ends after its
rounds in `finishing`, and closing a round or failing a job (which all three do) in `endings`."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeAlias, TypeVar

from apiary import metrics, telemetry
from apiary.bus import Bus, Delivery, Unroutable, publish_event
from apiary.bus.identity import worker_of
from apiary.contracts import (
    EVALUATE,
    INIT,
    MERGE,
    TRAIN,
    WAIT,
    AdapterMerged,
    JobSharded,
    JobWaiting,
    ObjectRef,
    RoundAggregated,
    RoundEvaluated,
    RoundFailed,
    RoundTimeout,
    ShardInfo,
    TaskKind,
    TaskTimeout,
    WeightsInitialized,
    WorkerDone,
    WorkerEvaluated,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
    pace_key,
)
from apiary.db import Database, Executor
from apiary.jobspec import JobSpec
from apiary.outbox import KeyedLocks, Outbox, Pending
from apiary.policy import Policy
from apiary.safetensors_header import WeightsError
from apiary.settings import Settings
from apiary.status import JobStatus, RoundStatus
from apiary.storage import ObjectNotFound, Storage
from services.scheduler import endings, shard_evaluations, shard_states, store, task_proofs
from services.scheduler.async_rounds import AsyncVersions
from services.scheduler.commands import JobCommands
from services.scheduler.evaluation import (
    DONE,
    FAILED,
    NONE,
    PENDING,
    Evaluation,
    evaluation_due,
    judged_by_evaluation,
    may_be_kept,
    may_end,
    planned_rounds,
    task_timeout,
)
from services.scheduler.finishing import JobFinisher
from services.scheduler.initial_and_final import checked_initial_weights, initial_weights, no_initial_weights
from services.scheduler.job_machine import Next, after_aggregated, after_failed, is_current, too_many_failures
from services.scheduler.presence import FleetPace, PaceReminders, PresenceFilter
from services.scheduler.pruning import AggregatedRound, PruneSchedule, abort_uploads, prune_after
from services.scheduler.round_plan import (
    NO_WEIGHTS,
    RoundTarget,
    online_preferences,
    plan_round,
    round_start,
    url_lifetime,
    usable_workers,
    waiting_for_workers,
)
from services.scheduler.routing import AssignmentRouter
from services.scheduler.store import Job
from services.scheduler.task_assignments import TaskQueue

log = logging.getLogger("apiary.scheduler")

# The events that say a worker is (or is no longer) online.
Presence: TypeAlias = WorkerOnline | WorkerHeartbeat | WorkerOffline
# A round's outcome, handled only if it is for the attempt its job runs now.
Outcome = TypeVar("Outcome", RoundAggregated, RoundFailed)


class SchedulerHandlers:
    """Runs each job's state machine; every transition is stored with the events it causes."""

    def __init__(self, db: Database, bus: Bus, storage: Storage, outbox: Outbox, settings: Settings) -> None:
        self._db, self._storage, self._outbox = db, storage, outbox
        self._settings = settings
        self._router = AssignmentRouter(bus, storage)
        self._tasks = TaskQueue(storage, self._router, settings.presign_ttl)
        self._pace = FleetPace.of(settings)
        self._reminders = PaceReminders()
        self._finisher = JobFinisher(db, storage, outbox, tasks=self._tasks, offline_after=self._pace.offline_after)
        self._locks = KeyedLocks()
        self._pruning = PruneSchedule()  # when each job's spent contributions go
        self._presence = PresenceFilter(settings.worker_offline_after)
        self._bus = bus
        # Mode async (FedBuff): versions, and training tasks handed out as workers report.
        self.versions = AsyncVersions(db, storage, outbox, self._router, settings.presign_ttl)
        # A job's commands are handled in their own module, under the same per-job locks; the Scheduler
        # subscribes to them through this object.
        commands = JobCommands(db, storage, outbox, self._locks, policy=Policy.of(settings))
        self.on_job_requested = commands.on_job_requested
        self.on_job_cancel = commands.on_job_cancel
        self.fail_unfinished = commands.fail_unfinished

    # ------------------------------------------------------------ job.sharded, worker presence

    async def on_job_sharded(self, event: JobSharded, delivery: Delivery) -> None:
        """Shards are ready: start round 1 from the job's model, or first run its init task on a worker."""
        async with self._locks(event.job_id):
            job = await store.job(self._db, event.job_id)
            if job is None or job.status != JobStatus.SHARDING:
                return
            spec = job.spec
            if event.error:
                await self._fail(event.job_id, event.error)
                return
            try:
                weights = await initial_weights(self._storage, event.job_id, spec)
            except (WeightsError, ObjectNotFound, OSError, ValueError) as e:
                await self._fail(event.job_id, f"initial weights: {e}")
                return
            first = 0 if weights is None else 1  # round 0: fl_init_weights runs on a worker
            why = None if weights is None else await shard_states.personal_layers_refused(self._storage, spec, weights)
            if why is not None:
                await self._fail(event.job_id, why)
                return
            async with self._db.transaction() as tx:
                await store.set_sharded(tx, event.job_id, event.shards, event.dataset_id, weights or NO_WEIGHTS,
                                        time.time())
                await self._start_round(tx, RoundTarget(event.job_id, spec, event.shards, weights or NO_WEIGHTS,
                                                        first, 1))
        await self._outbox.flush()

    async def on_job_initialized(self, event: WeightsInitialized, delivery: Delivery) -> None:
        """A worker ran the job's fl_init_weights: its stored result starts round 1 (once), if the report comes
        from the init assignment's worker (else it is forged, and changes nothing)."""
        async with self._locks(event.job_id):
            if await self._forged(INIT, event, delivery):
                return
            job = await store.job(self._db, event.job_id)
            if job is None or job.status != JobStatus.RUNNING or (job.round, job.attempt) != (0, event.attempt):
                return
            if event.error or not event.found or event.weights is None:
                await self._fail(event.job_id, f"initial weights: {event.error or no_initial_weights(job.spec)}", 0)
                return
            try:
                weights = await checked_initial_weights(self._storage, event.job_id, event.weights)
            except (ObjectNotFound, ValueError) as e:
                await self._fail(event.job_id, f"initial weights from worker {event.worker_id}: {e}", 0)
                return
            why = await shard_states.personal_layers_refused(self._storage, job.spec, weights)
            if why is not None:
                await self._fail(event.job_id, why, 0)
                return
            log.info("job %s: initial weights made by worker %s", event.job_id, event.worker_id)
            async with self._db.transaction() as tx:
                await store.set_weights(tx, event.job_id, weights)
                await self._start_round(tx, RoundTarget(event.job_id, job.spec, job.shards, weights, 1, 1))
        await self._outbox.flush()

    async def on_worker_presence(self, event: Presence, delivery: Delivery) -> None:
        """Track which workers are online; start the rounds of jobs that were waiting for them."""
        sender = worker_of(delivery.user_id)
        if sender is not None and sender != event.worker_id:
            # Another worker's broker user speaking for this one: it must not make it look online (or gone).
            log.warning("presence of worker %s ignored: sent by worker %r's broker user", event.worker_id, sender)
            return
        online = not isinstance(event, WorkerOffline)
        kind = None if isinstance(event, WorkerOffline) else event.kind
        now = time.time()
        beats_every = event.interval if isinstance(event, WorkerHeartbeat) else None
        if isinstance(event, WorkerHeartbeat):
            self._pace.heard_beat(event.interval, now)
        self._presence.offline_after = self._pace.offline_after(now)
        action = self._presence.on_report(event.worker_id, online, now, announced=isinstance(event, WorkerOnline))
        try:
            if action.write:
                await store.record_presence(self._db, event.worker_id, online, now, kind)
            if action.joined:
                await self._start_waiting_jobs()
        except BaseException:
            self._presence.forget(event.worker_id)  # the retry writes and joins again
            raise
        if online and self._reminders.due(event.worker_id, beats_every, self._pace, now,
                                          announced=isinstance(event, WorkerOnline)):
            await self._remind_pace(event.worker_id)

    async def _remind_pace(self, worker_id: str) -> None:
        """Tell one worker the fleet's pace (it joined after the announcement, or beats faster than it says)."""
        announcement = self._pace.announcement
        if announcement is None:
            return
        try:
            await publish_event(self._bus, announcement, routing_key=pace_key(worker_id), persistent=False)
        except Unroutable:  # its control queue is gone: it left, and beats at its own pace when it comes back
            log.debug("pace not told to worker %s: no control queue", worker_id)

    async def _start_waiting_jobs(self) -> None:
        """A worker joined: start the rounds of the jobs waiting for workers, where they can start now."""
        for job_id in await store.job_ids(self._db, status=JobStatus.WAITING):
            async with self._locks(job_id):
                job = await store.job(self._db, job_id)
                if job is None or job.status != JobStatus.WAITING or job.merging is not None:
                    continue
                async with self._db.transaction() as tx:
                    await self._start_round(tx, _target(job, job.round, job.attempt))
            await self._outbox.flush()

    def online_since(self) -> float:
        """Since when a worker must have been seen to count as online now (the fleet's pace stretches it)."""
        now = time.time()
        return now - self._pace.offline_after(now)

    async def check_pace(self) -> None:
        """Count the workers online and, if the pace their number calls for changed, tell every worker
        (`presence.pace`, not kept on disk: the next change, or the pace in an assignment, replaces a lost one)."""
        now = time.time()
        workers = len(await store.online_workers(self._db, self._pace.counting_since(now)))
        announcement = self._pace.decide(workers, now)
        if announcement is not None:
            log.info("heartbeats every %.1f s for %d workers online (offline after %.0f s)", announcement.interval,
                     workers, announcement.offline_after)
            await publish_event(self._bus, announcement, persistent=False)

    # ------------------------------------------------------------ round outcomes

    async def on_round_aggregated(self, event: RoundAggregated, delivery: Delivery) -> None:
        """A round's average is stored: start the next round, or finish the job."""
        await self._on_current(event, self._after_aggregated)

    async def _after_aggregated(self, job: Job, event: RoundAggregated) -> None:
        """Close the round, queue its evaluation (if due) and start the next round, or wait for the last
        round's evaluations; then end the job if its rounds say so (early stopping)."""
        spec = job.spec
        if job.last_round is not None:
            return  # a redelivered last round: it was handled
        decision = after_aggregated(event.round, planned_rounds(spec))
        async with self._db.transaction() as tx:
            await endings.close_round(tx, event.job_id, event.round, event.attempt, RoundStatus.AGGREGATED,
                                      weights_key=event.weights.key, metrics=event.metrics)
            await store.set_global_weights(tx, event.job_id, event.weights, event.metrics)
            await shard_states.record(tx, event)
            if decision.next is Next.FINISH:
                await store.set_last_round(tx, event.job_id, event.round)
                if spec.distributed.mode == "async":
                    # The tasks still out would go into no version: their workers stop them now, not when the job
                    # ends after its last evaluation.
                    await self.versions.end_training(tx, event.job_id, event.round)
            else:
                target = RoundTarget(event.job_id, spec, job.shards, event.weights, decision.round, decision.attempt)
                self.versions.adopt_trace(event.job_id, decision.round, event.next_traceparent)  # mode async
                await self._start_round(tx, target, prefer=event.trained_by)
            # Queued after the next round's assignments: a worker takes its training first.
            if evaluation_due(spec, event.round, job.evaluates):
                await self._queue_evaluation(tx, event.job_id, spec, event.round, event.attempt, event.weights,
                                             job.shards)
        # The next round's assignments go out now: the clean-up below costs S3 requests (a list and a delete per
        # contribution) that the round's workers must not wait for.
        await self._outbox.flush()
        # The round's result is durable: what no round needs any more goes (distributed.transfer.keep_contributions).
        # Not in mode async: there an attempt numbers a task, and tasks of a version still train or wait in the
        # open version's buffer (an aggregator that restarts folds them again), so every contribution stays.
        if spec.distributed.mode != "async":
            earlier = self._pruning.due(event.job_id, event.round, time.time(), last=decision.next is Next.FINISH)
            if earlier is not None:
                done = AggregatedRound(event.job_id, event.round, event.attempt,
                                       await store.attempts(self._db, event.job_id, earlier),
                                       [s.index for s in job.shards], trained_from=job.weights, weights=event.weights,
                                       pruned_at=earlier.start)
                await prune_after(self._storage, done, spec.distributed.transfer)
            if event.shard_states and not spec.distributed.transfer.keep_contributions:
                await self._prune_shard_states(job, event.round)
        if may_end(spec, decision.next is Next.FINISH):
            # Read back before the next round's assignments go out: skipped where nothing can end the job yet.
            await self._finisher.settle(event.job_id)

    async def _prune_shard_states(self, job: Job, round_index: int) -> None:
        """Delete the shard states no round the job may still end with needs (round `round_index` aggregated)."""
        rounds = await store.aggregated_rounds(self._db, job.job_id)
        rows = await store.evaluations(self._db, job.job_id)
        evaluations = [Evaluation(r["round"], r["status"], r["metrics"], r["error"]) for r in rows]
        metrics = {index: r["metrics"] for index, r in rounds.items()}
        kept = may_be_kept(job.spec, judged_by_evaluation(job.spec, job.evaluates), metrics, evaluations)
        # A shard's evaluation still to come scores the shard's state as its round left it.
        scored = {e.round for e in evaluations if e.status == PENDING}
        await shard_states.prune(self._storage, self._db, job.job_id, round_index, kept | scored)

    async def _queue_evaluation(self, tx: Executor, job_id: str, spec: JobSpec, round_index: int, attempt: int,
                                weights: ObjectRef, shards: Sequence[ShardInfo] = ()) -> None:
        """Queue the round's evaluation on a worker (a personal-layers job: each shard's, where its data is); the
        next round does not wait for it."""
        now = time.time()
        online = set(await store.online_workers(tx, now - self._pace.offline_after(now)))
        await store.insert_evaluation(tx, job_id, round_index, weights.key, now)
        if shards and shard_evaluations.by_shard(spec, round_index):
            await shard_evaluations.insert(tx, job_id, round_index, [s.index for s in shards])
            states = await shard_states.as_of(tx, job_id, round_index)
            queued = await self._tasks.evaluate_shards(job_id, spec, round_index, attempt, weights, shards, states,
                                                       online, now)
        else:
            queued = await self._tasks.evaluate(job_id, spec, round_index, attempt, weights, online, now)
        await task_proofs.remember(tx, queued)
        await self._outbox.add_all(tx, queued)

    async def on_worker_report(self, event: WorkerDone | WorkerFailed, delivery: Delivery) -> None:
        """Mode async: a worker reported a training task (`worker.done.async` / `worker.failed.async`); the next
        task goes out at once (services.scheduler.async_rounds). A synchronous job's reports are the aggregator's
        alone: they never reach this queue, and one sent under the async key anyway changes nothing here."""
        if not await self.versions.is_async(event.job_id):
            return
        async with self._locks(event.job_id):
            job = await store.job(self._db, event.job_id)
            if job is not None:
                await self.versions.on_report(event, delivery, job)

    async def on_worker_evaluated(self, event: WorkerEvaluated, delivery: Delivery) -> None:
        """A worker evaluated a round: its metrics are recorded (once) and announced as `round.evaluated`, if the
        report comes from the evaluate assignment's worker (else it is forged); the job may end now."""
        async with self._locks(event.job_id):
            if await self._forged(EVALUATE, event, delivery):
                return
            job = await store.job(self._db, event.job_id)
            if job is None or job.status.terminal:
                return
            if await store.evaluation_status(self._db, event.job_id, event.round) != PENDING:
                log.info("job %s: round %d's evaluation already recorded; duplicate ignored", event.job_id,
                         event.round)
                return
            status = NONE if not event.found else FAILED if event.error else DONE
            if event.error:
                log.warning("job %s: evaluation of round %d failed: %s", event.job_id, event.round, event.error)
            if event.shard is not None:
                await self._shard_evaluated(job, event, status)
            else:
                await self._evaluated(job, event, status)
        await self._outbox.flush()

    async def _evaluated(self, job: Job, event: WorkerEvaluated, status: str) -> None:
        """The global model scored: recorded and announced; the job may end now."""
        async with self._db.transaction() as tx:
            await store.settle_evaluation(tx, event.job_id, event.round, status, time.time(),
                                          metrics=event.metrics, error=event.error, worker_id=event.worker_id)
            await self._outbox.add(tx, RoundEvaluated.model_validate(event.model_dump(exclude={"secret"})))
            if status != FAILED and job.evaluates is None:
                await store.set_evaluates(tx, event.job_id, event.found)
        await self._finisher.settle(event.job_id)

    async def _shard_evaluated(self, job: Job, event: WorkerEvaluated, status: str) -> None:
        """One shard's personalised model scored: kept (once); the round's evaluation settles with the last one."""
        async with self._db.transaction() as tx:
            if not await shard_evaluations.settle(tx, event.job_id, event.round, int(event.shard or 0), status,
                                                  event.metrics, event.error, event.worker_id):
                return
            settled = await self._settle_by_shard(tx, job, event.round, event.attempt)
        if settled:
            await self._finisher.settle(event.job_id)

    async def _settle_by_shard(self, tx: Executor, job: Job, round_index: int, attempt: int) -> bool:
        """Settle a round's evaluation from its shards' reports once none is pending, and announce it; whether it
        settled."""
        reports = await shard_evaluations.reports(tx, job.job_id, round_index)
        summary = shard_evaluations.summary(reports) if reports else None
        if summary is None:
            return False
        await store.settle_evaluation(tx, job.job_id, round_index, summary.status, time.time(),
                                      metrics=summary.metrics, error=summary.error, worker_id=summary.workers)
        await self._outbox.add(tx, RoundEvaluated(job_id=job.job_id, round=round_index, attempt=attempt,
                                                  worker_id=summary.workers,
                                                  **shard_evaluations.as_dict(summary)))
        if summary.status != FAILED and job.evaluates is None:
            await store.set_evaluates(tx, job.job_id, summary.status != NONE)
        return True

    async def on_adapter_merged(self, event: AdapterMerged, delivery: Delivery) -> None:
        """A worker merged a built-in job's final adapter into its base model: the job completes (or fails), if
        the report comes from the merge assignment's worker (else it is forged, and changes nothing)."""
        async with self._locks(event.job_id):
            if not await self._forged(MERGE, event, delivery):
                await self._finisher.on_merged(event)
        await self._outbox.flush()

    async def _forged(self, task: TaskKind, report: task_proofs.TaskReport, delivery: Delivery) -> bool:
        """Whether a task report is forged (not from its assignment's worker): if so, announce it (whatever
        the job's state: a forged report is worth seeing even when it would change nothing) and say so."""
        refused = await task_proofs.forged(self._db, task, report, delivery.user_id)
        if refused is None:
            return False
        log.warning("job %s: %s from worker %s is forged: %s", report.job_id, report.routing_key, report.worker_id,
                    refused.reason)
        async with self._db.transaction() as tx:
            await self._outbox.add(tx, refused)
        await self._outbox.flush()
        return True

    async def on_task_timeout(self, event: TaskTimeout, delivery: Delivery) -> None:
        """An init, evaluate or merge task's time is up: a job still waiting for its initial weights or its
        merged model fails; an evaluation not in yet is recorded as failed (the job goes on). A mode-async
        training task still out loses its slot, and its shard goes out again."""
        async with self._locks(event.job_id):
            job = await store.job(self._db, event.job_id)
            if job is None or job.status.terminal:
                return
            if event.task == TRAIN:  # a mode-async training task (services.scheduler.async_rounds)
                await self.versions.on_task_timeout(event, job)
                return
            if event.task == WAIT:  # a mode-async worker's wait for a version
                await self.versions.on_wait_over(event, job)
                return
            timeout = task_timeout(job.spec)
            if event.task == MERGE:
                await self._finisher.merge_timed_out(job, event.round, timeout)
                await self._outbox.flush()
                return
            if event.task == INIT:
                if job.status == JobStatus.RUNNING and (job.round, job.attempt) == (0, event.attempt):
                    await self._fail(event.job_id, f"initial weights: no worker made them within {timeout:.0f}s", 0)
                return
            if await store.evaluation_status(self._db, event.job_id, event.round) != PENDING:
                return
            why = f"no worker reported it within {timeout:.0f}s"
            log.warning("job %s: evaluation of round %d failed: %s", event.job_id, event.round, why)
            async with self._db.transaction() as tx:
                if shard_evaluations.by_shard(job.spec, event.round):
                    await shard_evaluations.give_up(tx, event.job_id, event.round, why)
                    await self._settle_by_shard(tx, job, event.round, event.attempt)
                await store.settle_evaluation(tx, event.job_id, event.round, FAILED, time.time(), error=why)
            await self._finisher.settle(event.job_id)
        await self._outbox.flush()

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
            await endings.close_round(tx, event.job_id, event.round, event.attempt, RoundStatus.FAILED,
                                      reason=event.reason)
            if decision.next is Next.FAIL:
                reason = too_many_failures(event.round, decision.failures, tolerance, event.reason)
                await endings.fail_job(tx, self._outbox, event.job_id, reason, event.round)
            else:
                await store.set_failures(tx, event.job_id, decision.failures)
                await self._start_round(tx, _target(job, decision.round, decision.attempt))
        # The attempt's assignments have ended: what their uploads left incomplete will never be completed (in mode
        # async an attempt numbers one task, and the version's other tasks may still be uploading).
        if job.spec.distributed.mode != "async" and job.spec.distributed.transfer.in_parts(job.weights.size):
            await abort_uploads(self._storage, event.job_id, event.round, event.attempt)

    async def _on_current(self, event: Outcome, act: Callable[[Job, Outcome], Awaitable[None]]) -> None:
        """Under the job's lock, `act` on the running job if the outcome is for the attempt it runs now
        (else it is late or a duplicate, and ignored); then publish what it stored. A job whose adapter is
        being merged has ended its rounds (it stopped early while one ran): no round of it goes on."""
        async with self._locks(event.job_id):
            job = await store.job(self._db, event.job_id)
            if job is None or job.status != JobStatus.RUNNING or job.merging is not None:
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
        now = time.time()
        seen = await store.online_workers(tx, now - self._pace.offline_after(now))
        online, wrong = usable_workers(seen, spec.worker_selection.kinds)
        # Round 0 (the init task) needs one worker of the job's; its rounds need min_workers.
        needed = 1 if target.round == 0 else spec.distributed.min_workers
        waiting = waiting_for_workers(needed, spec.worker_selection.pinned, online, wrong)
        if waiting is not None:
            await store.set_waiting(tx, target.job_id, target.round, target.attempt, waiting.reason, time.time())
            await self._outbox.add(tx, JobWaiting(job_id=target.job_id, reason=waiting.reason, round=target.round,
                                                  online=waiting.online, required=waiting.required))
            log.info("job %s: round %d %s", target.job_id, target.round, waiting.reason)
            return
        await store.end_waiting(tx, target.job_id)
        if target.round == 0:
            await self._launch_init(tx, target, online)
            return
        for reason in wrong.values():
            log.warning("job %s: round %d: %s: its shard gets no assignment", target.job_id, target.round, reason)
        await self._launch_round(tx, target, online_preferences(prefer, online), absent=set(wrong))

    async def _launch_init(self, tx: Executor, target: RoundTarget, online: set[str]) -> None:
        """Round 0: queue the job's init task (its fl_init_weights, on a worker)."""
        now = time.time()
        await store.set_current(tx, target.job_id, 0, target.attempt, now)
        queued = await self._tasks.init(target.job_id, target.spec, target.attempt, online, now)
        await task_proofs.remember(tx, queued)
        await self._outbox.add_all(tx, queued)
        log.info("job %s: initial weights asked of a worker (fl_init_weights)", target.job_id)

    async def _launch_round(self, tx: Executor, target: RoundTarget, prefer: dict[int, str],
                            absent: set[str] | None = None) -> None:
        """Store the round and queue round.start, one assignment per shard (none for a shard listed on an
        `absent` worker: the round's timeout finds it missing) and the delayed timeout."""
        if target.spec.distributed.buffered is not None:
            await self.versions.launch(tx, target, prefer)
            if (target.round, target.attempt) == (1, 1) and evaluation_due(target.spec, 0, None):
                await self._queue_evaluation(tx, target.job_id, target.spec, 0, 1, target.weights)
            return
        plan = plan_round(target.spec, target.shards, time.time())
        trace_ids = telemetry.new_round_ids()
        trace = telemetry.headers_for(telemetry.round_context(*trace_ids))
        await store.insert_round(tx, target.job_id, target.round, target.attempt, [s.index for s in plan.chosen],
                                 plan.started_at, plan.deadline, trace_ids)
        queued = [Pending(round_start(target, plan), headers=trace)]
        ttl = url_lifetime(plan, self._settings.presign_ttl)
        beat = {"heartbeat_interval": self._pace.interval} if self._pace.stretched else {}
        states, server_state = await shard_states.current(tx, target.job_id)
        for assignment, routing_key in await self._router.assignments(target, plan, prefer, ttl):
            if assignment.pinned_worker in (absent or ()):
                continue
            carried = shard_states.assignment_fields(self._storage, assignment, states, server_state,
                                                     target.spec.distributed.personal_layers, ttl)
            queued.append(Pending(assignment.model_copy(update={**beat, **carried}), routing_key=routing_key,
                                  headers=trace))
        queued.append(Pending(RoundTimeout(job_id=target.job_id, round=target.round, attempt=target.attempt),
                              delay=plan.timeout, headers=trace))
        await self._outbox.add_all(tx, queued)
        metrics.round_started()
        log.info("job %s: round %d/%d (attempt %d) started on %d shards", target.job_id, target.round,
                 target.spec.distributed.num_rounds, target.attempt, len(plan.chosen))
        if (target.round, target.attempt) == (1, 1) and evaluation_due(target.spec, 0, None):
            # The starting model's score (a built-in job's base with its initial adapter), once, after round 1's
            # assignments: a worker takes its training first.
            await self._queue_evaluation(tx, target.job_id, target.spec, 0, 1, target.weights)

    async def _fail(self, job_id: str, reason: str, round_index: int | None = None) -> None:
        """Fail the job for `reason` and publish why."""
        async with self._db.transaction() as tx:
            await endings.fail_job(tx, self._outbox, job_id, reason, round_index)
        await self._outbox.flush()


def _target(job: Job, round_index: int, attempt: int) -> RoundTarget:
    """A round of a stored job, from its current global weights."""
    return RoundTarget(job.job_id, job.spec, job.shards, job.weights, round_index, attempt)
