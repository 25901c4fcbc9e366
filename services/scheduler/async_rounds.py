"""Mode async (FedBuff) in the scheduler: a version is a round whose tasks are whatever trains while it is
open. A version starts as a round does (round.start, its delayed timeout, a rounds row: the dashboard, API and
traces see it as one) but hands out no barrier of assignments: the job keeps `concurrency` training tasks out,
and a worker that reports one gets the next at once, from the newest version, without waiting for any other.

A task is (round, attempt, shard): `round` is the version open when it was handed out (it trains from version
round - 1) and `attempt` numbers the job's tasks, so every task has its own upload and secret. The task's secret
digest goes to the aggregator on `round.assigned`; this side keeps it too, and frees the task's slot once, on a
report that proves it comes from the task's worker."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace

from apiary import keys, metrics, proof, telemetry
from apiary.bus import Delivery
from apiary.contracts import (
    TRAIN,
    WAIT,
    JobTrainingEnded,
    RoundAssigned,
    RoundTimeout,
    ShardInfo,
    TaskTimeout,
    WorkerDone,
    WorkerFailed,
)
from apiary.db import Database, Executor
from apiary.jobspec_async import AsyncConfig
from apiary.outbox import Outbox, Pending
from apiary.status import JobStatus
from apiary.storage import Storage
from services.scheduler import store
from services.scheduler.round_plan import RoundPlan, RoundTarget, assignment, round_start, route
from services.scheduler.routing import AssignmentRouter
from services.scheduler.version_wait import HISTORY, Task, wait_for_version, waiters_shards

log = logging.getLogger("apiary.scheduler")

COMPONENT = "scheduler_async"
TRAINING, DONE, LOST, STOPPED = "training", "done", "lost", "stopped"
# Append only, as every component's migrations.
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS async_slots (
      job_id TEXT NOT NULL, attempt BIGINT NOT NULL, round BIGINT NOT NULL, shard BIGINT NOT NULL,
      status TEXT NOT NULL, worker_id TEXT, secret_digest TEXT NOT NULL, issued_at DOUBLE PRECISION NOT NULL,
      ended_at DOUBLE PRECISION, PRIMARY KEY (job_id, attempt));
    CREATE INDEX IF NOT EXISTS async_slots_training ON async_slots (job_id, status);
    """,
]
# The workers waiting for a version that is due (services.scheduler.version_wait), each keeping its slot meanwhile:
# a component of its own, so a database made before it gets the table too.
WAITS_COMPONENT = "scheduler_async_waits"
WAITS_MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS async_waits (
      job_id TEXT NOT NULL, worker_id TEXT NOT NULL, attempt BIGINT NOT NULL, since DOUBLE PRECISION NOT NULL,
      PRIMARY KEY (job_id, worker_id));
    """,
]

Report = WorkerDone | WorkerFailed


def next_shards(free: int, shards: list[int], training: set[int], after: int | None = None) -> list[int]:
    """The `free` shards to hand out next: those not training, in index order from the one after `after`
    (round robin, so every shard keeps being trained when fewer train at once than there are shards)."""
    idle = [s for s in shards if s not in training]
    if after is not None:
        idle = sorted(idle, key=lambda s: (s <= after, s))
        if after in idle and len(idle) > free:  # the reporter's own shard only when nothing else waits
            idle.remove(after)
            idle.append(after)
    return idle[:free]


class AsyncVersions:
    """Starts the versions of async jobs and keeps their training tasks out."""

    def __init__(self, db: Database, storage: Storage, outbox: Outbox, router: AssignmentRouter,
                 presign_ttl: int) -> None:
        self._db, self._storage, self._outbox, self._router = db, storage, outbox, router
        self._presign_ttl = presign_ttl
        self._modes: dict[str, bool] = {}  # job -> whether it is async (a job's mode never changes)
        # (job, version) -> the trace ids the aggregator gave the version it opened (round.aggregated).
        self._traces: dict[tuple[str, int], tuple[int, int]] = {}

    def adopt_trace(self, job_id: str, version: int, traceparent: str | None) -> None:
        """The next version's round span gets the ids the aggregator opened it with (`00-<trace>-<span>-01`), so
        its aggregation and its tasks share one trace."""
        parts = (traceparent or "").split("-")
        if len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16:
            self._traces[(job_id, version)] = (int(parts[1], 16), int(parts[2], 16))

    async def migrate(self) -> None:
        """Create or update the async tables."""
        await self._db.migrate(COMPONENT, MIGRATIONS)
        await self._db.migrate(WAITS_COMPONENT, WAITS_MIGRATIONS)

    async def is_async(self, job_id: str) -> bool:
        """Whether the job runs in mode async (read once per job)."""
        known = self._modes.get(job_id)
        if known is None:
            job = await store.job(self._db, job_id)
            if job is None:
                return False
            known = self._modes[job_id] = job.spec.distributed.buffered is not None
        return known

    async def launch(self, tx: Executor, target: RoundTarget, prefer: Mapping[int, str]) -> None:
        """Start version `target.round` (attempt `target.attempt`): its row, round.start and timeout; and top the
        job's training tasks up to `concurrency` (all of them anew on a retry: the failed version's are lost)."""
        spec = target.spec
        settings = spec.distributed.buffered
        assert settings is not None
        now = time.time()
        timeout = spec.distributed.aggregation_timeout
        shards = [s.index for s in target.shards]
        plan = RoundPlan(chosen=target.shards, started_at=now, timeout=timeout, deadline=now + timeout)
        trace_ids = self._traces.pop((target.job_id, target.round), None) or telemetry.new_round_ids()
        trace = telemetry.headers_for(telemetry.round_context(*trace_ids))
        await store.insert_round(tx, target.job_id, target.round, target.attempt, shards, now, plan.deadline,
                                 trace_ids)
        start = round_start(target, plan).model_copy(update={"asynchronous": settings, "secret_digests": {},
                                                             "progress_digests": {}})
        queued = [Pending(start, headers=trace)]
        if target.attempt > 1:
            await tx.execute("UPDATE async_slots SET status = $3, ended_at = $4 WHERE job_id = $1 AND status = $2",
                             target.job_id, TRAINING, LOST, now)
        training = await self._training(tx, target.job_id)
        chosen = next_shards(settings.slots - len(training), shards, training)
        # The workers that waited for this version get its first tasks (their slots were kept for them), each its
        # own shard again where it can.
        waiting = await tx.fetch("SELECT w.worker_id, s.shard FROM async_waits w JOIN async_slots s ON s.job_id ="
                                 " w.job_id AND s.attempt = w.attempt WHERE w.job_id = $1 ORDER BY w.since",
                                 target.job_id)
        await tx.execute("DELETE FROM async_waits WHERE job_id = $1", target.job_id)
        waiters = waiters_shards(chosen, [(r["worker_id"], int(r["shard"])) for r in waiting])
        for shard in chosen:
            queued += await self._task(tx, target, settings, shard, waiters.get(shard) or prefer.get(shard), now,
                                       trace)
        queued.append(Pending(RoundTimeout(job_id=target.job_id, round=target.round, attempt=target.attempt),
                              delay=timeout, headers=trace))
        await self._outbox.add_all(tx, queued)
        metrics.round_started()
        log.info("job %s: version %d/%d (attempt %d) open; %d tasks training", target.job_id, target.round,
                 spec.distributed.num_rounds, target.attempt, len(training) + len(chosen))

    async def on_report(self, event: Report, delivery: Delivery, job: store.Job) -> None:
        """A task's report (under the job's lock): if it proves to come from the task's worker and the task was
        still training, its slot is free, and the next task goes out at once (to the same worker first), from the
        newest version; or, where that version is about to be superseded, the worker waits for the next one
        (`version_wait`). Anything else (forged, a duplicate, a lost task) changes nothing here: the aggregator
        records what it is."""
        row = await self._db.fetchrow("SELECT * FROM async_slots WHERE job_id = $1 AND attempt = $2 AND round = $3"
                                      " AND shard = $4", event.job_id, event.attempt, event.round, event.shard)
        if row is None or row["status"] != TRAINING:
            return
        if proof.judge(event.worker_id, delivery.user_id, event.secret, row["secret_digest"],
                       about=f"shard {event.shard}") is not None:
            return
        now = time.time()
        async with self._db.transaction() as tx:
            freed = await tx.execute("UPDATE async_slots SET status = $3, ended_at = $4, worker_id = $6 WHERE"
                                     " job_id = $1 AND attempt = $2 AND status = $5", event.job_id, event.attempt,
                                     DONE, now, TRAINING, event.worker_id)
            if not freed or job.status != JobStatus.RUNNING or job.last_round is not None or job.merging is not None:
                return
            wait = await self._wait(tx, job, now, took=now - float(row["issued_at"]))
            if wait is None:
                await self._top_up(tx, job, after=event.shard, worker=event.worker_id, now=now)
            else:
                await tx.execute("INSERT INTO async_waits (job_id, worker_id, attempt, since) VALUES ($1, $2, $3, $4)"
                                 " ON CONFLICT (job_id, worker_id) DO UPDATE SET attempt = $3, since = $4",
                                 event.job_id, event.worker_id, event.attempt, now)
                await self._outbox.add_all(tx, [Pending(TaskTimeout(job_id=event.job_id, round=job.round,
                                                                    attempt=event.attempt, task=WAIT), delay=wait)])
                log.debug("job %s: worker %s waits up to %.2fs for version %d", event.job_id, event.worker_id, wait,
                          job.round)
        await self._outbox.flush()

    async def _wait(self, tx: Executor, job: store.Job, now: float, took: float) -> float | None:
        """How long the worker that just reported (its task took `took` s) waits for the open version, or None
        (services.scheduler.version_wait)."""
        settings = job.spec.distributed.buffered
        assert settings is not None
        if settings.version_wait <= 0:
            return None
        version = await store.running_round(tx, job.job_id, job.round, job.attempt)
        if version is None:
            return None
        folded = int(await tx.fetchval("SELECT COUNT(*) FROM async_slots WHERE job_id = $1 AND status = $2 AND"
                                       " ended_at >= $3", job.job_id, DONE, float(version["started_at"])) or 0)
        training = [Task(int(r["shard"]), r["worker_id"], float(r["issued_at"])) for r in await tx.fetch(
            "SELECT shard, worker_id, issued_at FROM async_slots WHERE job_id = $1 AND status = $2", job.job_id,
            TRAINING)]
        # The first version's tasks started their workers' training processes: their times say nothing of the next.
        history = [Task(int(r["shard"]), r["worker_id"], float(r["issued_at"]), float(r["ended_at"]))
                   for r in await tx.fetch("SELECT shard, worker_id, issued_at, ended_at FROM async_slots WHERE"
                                           " job_id = $1 AND status = $2 AND round > 1 ORDER BY attempt DESC LIMIT $3",
                                           job.job_id, DONE, HISTORY * max(settings.slots, len(job.shards)))]
        return wait_for_version(now, took, settings.version_wait, settings.k, folded, training, history)

    async def on_wait_over(self, event: TaskTimeout, job: store.Job) -> None:
        """A worker's wait for a version is up (under the job's lock): if the version has not come (its task is
        still kept for it), the worker's next task goes out now, from the newest version."""
        now = time.time()
        async with self._db.transaction() as tx:
            row = await tx.fetchrow("SELECT w.worker_id, s.shard FROM async_waits w JOIN async_slots s ON"
                                    " s.job_id = w.job_id AND s.attempt = w.attempt WHERE w.job_id = $1 AND"
                                    " w.attempt = $2", event.job_id, event.attempt)
            if row is None:
                return
            await tx.execute("DELETE FROM async_waits WHERE job_id = $1 AND attempt = $2", event.job_id,
                             event.attempt)
            if job.status != JobStatus.RUNNING or job.last_round is not None or job.merging is not None:
                return
            log.info("job %s: the version worker %s waited for did not come in time; its next task goes out from "
                     "version %d", event.job_id, row["worker_id"], job.round - 1)
            await self._top_up(tx, job, after=int(row["shard"]), worker=row["worker_id"], now=now)
        await self._outbox.flush()

    async def end_training(self, tx: Executor, job_id: str, version: int) -> None:
        """The job's last version is stored: its tasks still training are stopped (their workers hear it on
        job.training_ended, published with this transaction) and go into no version."""
        await tx.execute("UPDATE async_slots SET status = $3, ended_at = $4 WHERE job_id = $1 AND status = $2",
                         job_id, TRAINING, STOPPED, time.time())
        await tx.execute("DELETE FROM async_waits WHERE job_id = $1", job_id)
        await self._outbox.add(tx, JobTrainingEnded(job_id=job_id, version=version))

    async def on_task_timeout(self, event: TaskTimeout, job: store.Job) -> None:
        """A training task's deadline passed (under the job's lock): if it is still training, no report came in its
        time (its worker hung, or its report was lost), so its slot is lost and its shard goes out again at once, to
        any worker. A report that comes later changes nothing here (the aggregator may still fold it, weighted by its
        staleness like any other)."""
        now = time.time()
        async with self._db.transaction() as tx:
            row = await tx.fetchrow("SELECT shard, worker_id FROM async_slots WHERE job_id = $1 AND attempt = $2"
                                    " AND status = $3", event.job_id, event.attempt, TRAINING)
            if row is None:
                return
            await tx.execute("UPDATE async_slots SET status = $3, ended_at = $4 WHERE job_id = $1 AND attempt = $2",
                             event.job_id, event.attempt, LOST, now)
            log.warning("job %s: task %d (shard %d, worker %s) did not report by its deadline; its shard goes out "
                        "again", event.job_id, event.attempt, row["shard"], row["worker_id"] or "any")
            if job.status != JobStatus.RUNNING or job.last_round is not None or job.merging is not None:
                return
            await self._top_up(tx, job, after=int(row["shard"]), worker=None, now=now)
        await self._outbox.flush()

    async def _top_up(self, tx: Executor, job: store.Job, after: int, worker: str | None, now: float) -> None:
        """Hand out training tasks from the newest version until `concurrency` train, less the slots kept for
        workers waiting for the next version (the shards in turn from the one after `after`), the first to `worker`
        where one is named."""
        settings = job.spec.distributed.buffered
        assert settings is not None
        training = await self._training(tx, job.job_id)
        waiting = int(await tx.fetchval("SELECT COUNT(*) FROM async_waits WHERE job_id = $1", job.job_id) or 0)
        chosen = next_shards(max(0, settings.slots - len(training) - waiting), [s.index for s in job.shards],
                             training, after=after)
        target = RoundTarget(job.job_id, job.spec, job.shards, job.weights, job.round, job.attempt)
        # The task joins the trace of the version it starts in.
        version = await store.running_round(tx, job.job_id, job.round, job.attempt)
        trace = None if version is None else telemetry.headers_for(telemetry.round_context(
            int(version["trace_id"], 16), int(version["span_id"], 16)))
        queued: list[Pending] = []
        for shard in chosen:
            queued += await self._task(tx, target, settings, shard, worker, now, trace)
        await self._outbox.add_all(tx, queued)

    async def _training(self, tx: Executor, job_id: str) -> set[int]:
        rows = await tx.fetch("SELECT shard FROM async_slots WHERE job_id = $1 AND status = $2", job_id, TRAINING)
        return {int(r["shard"]) for r in rows}

    async def _task(self, tx: Executor, target: RoundTarget, settings: AsyncConfig, shard_index: int,
                    worker: str | None, now: float, trace: dict[str, str] | None) -> list[Pending]:
        """One training task of shard `shard_index` from the job's newest version, and its announcement."""
        spec = target.spec
        number = int(await tx.fetchval("SELECT COALESCE(MAX(attempt), 0) + 1 FROM async_slots WHERE job_id = $1",
                                       target.job_id))
        shard = _shard(target.shards, shard_index)
        task = replace(target, attempt=number)
        timeout = spec.distributed.aggregation_timeout
        secret = proof.new_secret()
        plan = RoundPlan(chosen=[shard], started_at=now, timeout=timeout, deadline=now + timeout,
                         secrets={shard_index: secret})
        ttl = int(timeout + self._presign_ttl)
        ended = self._storage.presign_get(keys.job_ended(target.job_id), ttl)
        urls = replace(self._router.urls(task, shard, ttl, ended), base_model=await self._router.base_model(spec, ttl))
        message = assignment(task, plan, shard, urls).model_copy(update={**self._router.code(spec, ttl),
                                                                           "asynchronous": True})
        prefer = {shard_index: worker} if worker else {}
        routing_key = await self._router.queue(route(shard_index, spec.worker_selection.pinned, prefer))
        await tx.execute("INSERT INTO async_slots (job_id, attempt, round, shard, status, worker_id, secret_digest,"
                         " issued_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)", target.job_id, number, target.round,
                         shard_index, TRAINING, worker, proof.digest(secret), now)
        assigned = RoundAssigned(job_id=target.job_id, round=target.round, attempt=number, shard=shard_index,
                                 weights=target.weights, secret_digest=proof.digest(secret),
                                 progress_digest=proof.digest(proof.progress_token(secret)))
        headers = trace or {}
        # The announcement first: the aggregator stores it before the task's report can arrive. The task's own
        # timeout frees its slot if no report comes by its deadline (a worker hung but alive, say).
        expiry = TaskTimeout(job_id=target.job_id, round=target.round, attempt=number, task=TRAIN)
        return [Pending(assigned, headers=headers), Pending(message, routing_key=routing_key, headers=headers),
                Pending(expiry, delay=timeout, headers=headers)]


def _shard(shards: list[ShardInfo], index: int) -> ShardInfo:
    for shard in shards:
        if shard.index == index:
            return shard
    raise ValueError(f"no shard {index}")
