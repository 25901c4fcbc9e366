"""Scheduler handlers: job.requested, job.sharded, round.aggregated, round.failed, job.cancel."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from pydantic import ValidationError

from apiary import keys, telemetry
from apiary.assignments import POOL, declare_preferred, pinned_queue, preferred_queue
from apiary.bus import Delivery, EventHandler, Raw, subscribe
from apiary.component import Component, from_json, to_json
from apiary.contracts import (
    Assignment,
    JobAccepted,
    JobCancelRequested,
    JobCompleted,
    JobFailed,
    JobRejected,
    JobRequested,
    JobSharded,
    JobWaiting,
    ObjectRef,
    RoundAggregated,
    RoundFailed,
    RoundStart,
    RoundTimeout,
    ShardInfo,
    ShardRequested,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
    decode_body,
)
from apiary.db import Executor
from apiary.jobspec import JobSpec, describe_errors, field_errors
from apiary.outbox import KeyedLocks, Outbox, Pending, outbox_migration
from apiary.status import JobStatus
from apiary.storage import ObjectNotFound
from apiary.trainers import UserCodeError, UserCodeRunner
from apiary.weights import WeightsError, read_header
from services.scheduler.state import (
    Next,
    after_aggregated,
    after_failed,
    is_current,
    workers_needed,
)

log = logging.getLogger("apiary.scheduler")

MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS jobs (
      job_id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL, status TEXT NOT NULL,
      round BIGINT NOT NULL DEFAULT 0, attempt BIGINT NOT NULL DEFAULT 0,
      failures BIGINT NOT NULL DEFAULT 0, shards TEXT, dataset_id TEXT,
      weights_key TEXT, weights_size BIGINT, weights_sha256 TEXT,
      reason TEXT, final_model TEXT, metrics TEXT,
      created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL);
    CREATE TABLE IF NOT EXISTS worker_presence (
      worker_id TEXT PRIMARY KEY, online BIGINT NOT NULL, last_seen DOUBLE PRECISION NOT NULL);
    CREATE TABLE IF NOT EXISTS rounds (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL, status TEXT NOT NULL,
      shards TEXT NOT NULL, started_at DOUBLE PRECISION NOT NULL, deadline DOUBLE PRECISION NOT NULL,
      ended_at DOUBLE PRECISION, reason TEXT, weights_key TEXT, metrics TEXT,
      PRIMARY KEY (job_id, round, attempt));
    """,
    outbox_migration("scheduler_outbox"),
    # The round span's ids, chosen when the round starts and recorded when it ends.
    "ALTER TABLE rounds ADD COLUMN trace_id TEXT; ALTER TABLE rounds ADD COLUMN span_id TEXT",
    # Cancels that arrived before their job's request (the two travel separately): the request, when it
    # comes, ends the job at once instead of starting it.
    """
    CREATE TABLE IF NOT EXISTS early_cancels (
      job_id TEXT PRIMARY KEY, reason TEXT NOT NULL, received_at DOUBLE PRECISION NOT NULL);
    """,
]

INIT_TIMEOUT = 600.0
DECLARE_EVERY = 300.0  # seconds between declarations of one worker queue by this process


class Scheduler(Component):
    """Runs each job's state machine; every transition is stored with the events it causes."""

    name = "scheduler"

    def __init__(self, *args: Any, runner: UserCodeRunner | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbox = Outbox(self.db, self.bus, "scheduler_outbox")
        self.runner = runner or UserCodeRunner(self.settings.code_path, name="apiary-scheduler-user-code")
        self._locks = KeyedLocks()
        self._declared: dict[str, float] = {}  # worker queue -> when this process last declared it

    async def start(self) -> None:
        await self.db.migrate(self.name, MIGRATIONS)
        await self.outbox.flush()
        handlers: dict[str, EventHandler | Raw] = {
            "job.requested": Raw(self.on_job_requested),
            "job.sharded": self.on_job_sharded,
            "round.aggregated": self.on_round_aggregated,
            "round.failed": self.on_round_failed,
            "job.cancel": self.on_job_cancel,
            "worker.online": self.on_worker_presence,
            "worker.heartbeat": self.on_worker_presence,
            "worker.offline": self.on_worker_presence,
        }
        self._subscriptions.append(
            await subscribe(self.bus, "scheduler", handlers, prefetch=self.settings.prefetch)
        )

    async def stop(self) -> None:
        await super().stop()
        await self.runner.stop()

    # ------------------------------------------------------------ job.requested

    async def on_job_requested(self, delivery: Delivery) -> None:
        """Validate a job request; accept it and ask for shards, or reject it naming each bad field."""
        data = decode_body(delivery.body, delivery.content_type)
        raw_id = data.get("job_id")
        job_id = raw_id if isinstance(raw_id, str) and raw_id else uuid.uuid4().hex[:12]
        try:
            request = JobRequested.model_validate(data)
        except ValidationError as e:
            errors = field_errors(e)
            reason = f"job request rejected: {describe_errors(errors)}"
            log.warning("job %s: %s", job_id, reason)
            async with self.db.transaction() as tx:
                await self.outbox.add(tx, JobRejected(job_id=job_id, reason=reason, errors=errors))
            await self.outbox.flush()
            return
        spec = JobSpec.model_validate(request.model_dump(exclude={"job_id", "v"}))
        async with self._locks(job_id):
            if await self.db.fetchval("SELECT job_id FROM jobs WHERE job_id = $1", job_id):
                log.info("job %s: duplicate request ignored", job_id)
                return
            now = time.time()
            cancel = await self.db.fetchval("SELECT reason FROM early_cancels WHERE job_id = $1", job_id)
            if cancel is not None:
                await self._accept_cancelled(job_id, spec, cancel, now)
                return
            async with self.db.transaction() as tx:
                await tx.execute(
                    "INSERT INTO jobs (job_id, name, spec, status, created_at, updated_at)"
                    " VALUES ($1, $2, $3, $4, $5, $5)",
                    job_id, spec.name, spec.model_dump_json(), JobStatus.SHARDING, now,
                )
                await self.outbox.add(tx, JobAccepted(job_id=job_id, name=spec.name,
                                                      num_rounds=spec.distributed.num_rounds,
                                                      num_shards=spec.num_shards))
                await self.outbox.add(tx, ShardRequested(
                    job_id=job_id, dataset=spec.dataset, dataset_id=spec.dataset_id,
                    num_shards=spec.num_shards, strategy=spec.split.strategy, seed=spec.split.seed,
                    alpha=spec.split.alpha, group_key=spec.split.key,
                ))
        log.info("job %s (%s) accepted", job_id, spec.name)
        await self.outbox.flush()

    async def _accept_cancelled(self, job_id: str, spec: JobSpec, reason: str, now: float) -> None:
        """A request whose cancel came first: recorded as a cancelled job that never ran."""
        async with self.db.transaction() as tx:
            await tx.execute(
                "INSERT INTO jobs (job_id, name, spec, status, reason, created_at, updated_at)"
                " VALUES ($1, $2, $3, $4, $5, $6, $6)",
                job_id, spec.name, spec.model_dump_json(), JobStatus.CANCELLED, reason, now,
            )
            await tx.execute("DELETE FROM early_cancels WHERE job_id = $1", job_id)
            await self.outbox.add(tx, JobAccepted(job_id=job_id, name=spec.name,
                                                  num_rounds=spec.distributed.num_rounds,
                                                  num_shards=spec.num_shards))
            await self.outbox.add(tx, JobFailed(job_id=job_id, reason=reason, round=0, cancelled=True))
        log.info("job %s (%s) cancelled before it started", job_id, spec.name)
        await self.outbox.flush()

    # ------------------------------------------------------------ job.sharded

    async def on_job_sharded(self, event: JobSharded, delivery: Delivery) -> None:
        """Shards are ready: make the initial weights and start round 1."""
        async with self._locks(event.job_id):
            job = await self._job(event.job_id)
            if job is None or job["status"] != JobStatus.SHARDING:
                return
            spec = JobSpec.model_validate_json(job["spec"])
            if event.error:
                await self._fail(event.job_id, event.error)
                return
            try:
                weights = await self._initial_weights(event.job_id, spec)
            except (UserCodeError, WeightsError, ObjectNotFound, OSError, ValueError) as e:
                await self._fail(event.job_id, f"initial weights: {e}")
                return
            async with self.db.transaction() as tx:
                await tx.execute(
                    "UPDATE jobs SET status = $2, shards = $3, dataset_id = $4, weights_key = $5,"
                    " weights_size = $6, weights_sha256 = $7, updated_at = $8 WHERE job_id = $1",
                    event.job_id, JobStatus.RUNNING, to_json([s.model_dump() for s in event.shards]),
                    event.dataset_id, weights.key, weights.size, weights.sha256, time.time(),
                )
                await self._start_round(tx, event.job_id, spec, event.shards, weights, 1, 1)
        await self.outbox.flush()

    async def _initial_weights(self, job_id: str, spec: JobSpec) -> ObjectRef:
        """Round 0's weights: the job's checkpoint, or the entrypoint module's fl_init_weights(env)."""
        target = keys.global_weights(job_id, 0)
        source = spec.model or spec.model_id
        if source:
            data = await self._read_model(source)
            read_header(data)
            return await self.storage.put_bytes(target, data)
        with tempfile.TemporaryDirectory(prefix="apiary-init-") as tmp:
            path = Path(tmp) / "init.safetensors"
            found = await self.runner.init_weights(spec.module, spec.env(0), path, timeout=INIT_TIMEOUT)
            if not found:
                raise ValueError(
                    f"no initial weights: give the job a 'model' checkpoint or define "
                    f"fl_init_weights(env) in {spec.module}"
                )
            read_header(await asyncio.to_thread(path.read_bytes))
            return await self.storage.put_file(target, path)

    async def _read_model(self, source: str) -> bytes:
        if source.startswith("file:"):
            return await asyncio.to_thread(Path(unquote(urlparse(source).path)).read_bytes)
        own = self.storage.uri("x").removesuffix("x")
        if source.startswith(own):
            return await self.storage.get_bytes(source.removeprefix(own))
        if "://" in source:
            raise ValueError(f"model {source} is outside this deployment's storage ({own})")
        if Path(source).is_file():
            return await asyncio.to_thread(Path(source).read_bytes)
        return await self.storage.get_bytes(source)

    # ------------------------------------------------------------ rounds

    async def _start_round(
        self,
        tx: Executor,
        job_id: str,
        spec: JobSpec,
        shards: list[ShardInfo],
        weights: ObjectRef,
        round_index: int,
        attempt: int,
        prefer: dict[int, str] | None = None,
    ) -> None:
        """Start the round if enough workers are online; else park the job as waiting, with why.
        `prefer` names the worker that trained each shard last round: it is offered the shard again."""
        pinned = spec.worker_selection.pinned
        present = await self._online(tx)
        online, required = workers_needed(spec.distributed.min_workers, pinned, present)
        if online < required:
            which = f" of its pinned workers {pinned}" if pinned else ""
            reason = f"waiting for workers: {online}{which} online, min_workers is {required}"
            await tx.execute(
                "UPDATE jobs SET status = $2, round = $3, attempt = $4, reason = $5, updated_at = $6"
                " WHERE job_id = $1",
                job_id, JobStatus.WAITING, round_index, attempt, reason, time.time(),
            )
            await self.outbox.add(tx, JobWaiting(job_id=job_id, reason=reason, round=round_index,
                                                 online=online, required=required))
            log.info("job %s: round %d %s", job_id, round_index, reason)
            return
        await tx.execute(
            "UPDATE jobs SET status = $2, reason = NULL WHERE job_id = $1 AND status = $3",
            job_id, JobStatus.RUNNING, JobStatus.WAITING,
        )
        prefer = {shard: worker for shard, worker in (prefer or {}).items() if worker in present}
        await self._launch_round(tx, job_id, spec, shards, weights, round_index, attempt, prefer)

    async def _online(self, tx: Executor) -> set[str]:
        cutoff = time.time() - self.settings.worker_offline_after
        rows = await tx.fetch("SELECT worker_id FROM worker_presence WHERE online = 1 AND last_seen >= $1", cutoff)
        return {r["worker_id"] for r in rows}

    async def on_worker_presence(self, event: WorkerOnline | WorkerHeartbeat | WorkerOffline,
                                 delivery: Delivery) -> None:
        """Track which workers are online; start the rounds of jobs that were waiting for them."""
        online = 0 if isinstance(event, WorkerOffline) else 1
        await self.db.execute(
            "INSERT INTO worker_presence (worker_id, online, last_seen) VALUES ($1, $2, $3)"
            " ON CONFLICT (worker_id) DO UPDATE SET online = $2, last_seen = $3",
            event.worker_id, online, time.time(),
        )
        if not online:
            return
        waiting = await self.db.fetch("SELECT job_id FROM jobs WHERE status = $1", JobStatus.WAITING)
        for row in waiting:
            async with self._locks(row["job_id"]):
                job = await self._job(row["job_id"])
                if job is None or job["status"] != JobStatus.WAITING:
                    continue
                spec = JobSpec.model_validate_json(job["spec"])
                shards = _shards(job)
                weights = _weights(job)
                async with self.db.transaction() as tx:
                    await self._start_round(tx, job["job_id"], spec, shards, weights, job["round"], job["attempt"])
            await self.outbox.flush()

    async def _launch_round(
        self,
        tx: Executor,
        job_id: str,
        spec: JobSpec,
        shards: list[ShardInfo],
        weights: ObjectRef,
        round_index: int,
        attempt: int,
        prefer: dict[int, str],
    ) -> None:
        """Store the round and queue round.start, one assignment per shard and the delayed timeout."""
        now = time.time()
        timeout = spec.distributed.aggregation_timeout
        deadline = now + timeout
        chosen = shards[: spec.distributed.max_workers]
        trace_id, span_id = telemetry.new_round_ids()
        trace = telemetry.headers_for(telemetry.round_context(trace_id, span_id))
        await tx.execute(
            "INSERT INTO rounds (job_id, round, attempt, status, shards, started_at, deadline, trace_id, span_id)"
            " VALUES ($1, $2, $3, 'running', $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
            job_id, round_index, attempt, to_json([s.index for s in chosen]), now, deadline,
            f"{trace_id:032x}", f"{span_id:016x}",
        )
        await tx.execute(
            "UPDATE jobs SET round = $2, attempt = $3, updated_at = $4 WHERE job_id = $1",
            job_id, round_index, attempt, now,
        )
        queued = [Pending(RoundStart(
            job_id=job_id, round=round_index, attempt=attempt, num_rounds=spec.distributed.num_rounds,
            shards=[s.index for s in chosen], min_workers=spec.distributed.min_workers, weights=weights,
            deadline=deadline, use_peft=spec.use_peft,
        ), headers=trace)]
        ttl = int(timeout + self.settings.presign_ttl)
        pinned = spec.worker_selection.pinned
        ended_url = self.storage.presign_get(keys.job_ended(job_id), ttl)
        for shard in chosen:
            result_key = keys.contribution(job_id, round_index, attempt, shard.index)
            files_key = keys.run_files(job_id, round_index, attempt, shard.index)
            worker = pinned[shard.index] if pinned else None
            assignment = Assignment(
                job_id=job_id, round=round_index, attempt=attempt, job_name=spec.name,
                num_rounds=spec.distributed.num_rounds, shard=shard.index, num_shards=len(shards),
                shard_num_samples=shard.num_samples, shard_url=self.storage.presign_get(shard.key, ttl),
                shard_sha256=shard.sha256, weights_url=self.storage.presign_get(weights.key, ttl),
                weights_sha256=weights.sha256, upload_url=self.storage.presign_put(result_key, ttl),
                result_key=result_key, files_upload_url=self.storage.presign_put(files_key, ttl),
                entrypoint=spec.entrypoint, env=spec.env(round_index), deadline=deadline,
                pinned_worker=worker, issued_at=now, ended_url=ended_url,
            )
            if worker:
                routing_key = await self._declare_worker_queue(worker, preferred=False)
            elif shard.index in prefer:
                # Its data is cached there; the pool takes it if that worker is busy or gone.
                routing_key = await self._declare_worker_queue(prefer[shard.index], preferred=True)
            else:
                routing_key = POOL
            queued.append(Pending(assignment, routing_key=routing_key, headers=trace))
        queued.append(Pending(RoundTimeout(job_id=job_id, round=round_index, attempt=attempt), delay=timeout,
                              headers=trace))
        await self.outbox.add_all(tx, queued)
        log.info("job %s: round %d/%d (attempt %d) started on %d shards", job_id, round_index,
                 spec.distributed.num_rounds, attempt, len(chosen))

    async def _declare_worker_queue(self, worker: str, *, preferred: bool) -> str:
        """The worker's pinned (or preferred) queue, made sure to exist before an assignment is queued
        there (the worker may not have started yet): declared at most every few minutes, not every
        round. A preferred queue is deleted only after an hour without a consumer, and only online
        workers are preferred."""
        queue = preferred_queue(worker) if preferred else pinned_queue(worker)
        now = time.monotonic()
        if now - self._declared.get(queue, -DECLARE_EVERY) >= DECLARE_EVERY:
            if preferred:
                await declare_preferred(self.bus, worker)
            else:
                await self.bus.declare_queue(queue, [queue])
            self._declared[queue] = now
        return queue

    async def on_round_aggregated(self, event: RoundAggregated, delivery: Delivery) -> None:
        """A round's average is stored: start the next round, or finish the job."""
        async with self._locks(event.job_id):
            current = await self._current(event)
            if current is None:
                return
            job, spec = current
            decision = after_aggregated(event.round, spec.distributed.num_rounds)
            if decision.next is Next.FINISH:
                await self._finish(job, spec, event)
                return
            shards = _shards(job)
            async with self.db.transaction() as tx:
                await self._close_round(tx, event.job_id, event.round, event.attempt, "aggregated",
                                        weights_key=event.weights.key, metrics=event.metrics)
                await tx.execute(
                    "UPDATE jobs SET weights_key = $2, weights_size = $3, weights_sha256 = $4, failures = 0,"
                    " metrics = $5 WHERE job_id = $1",
                    event.job_id, event.weights.key, event.weights.size, event.weights.sha256,
                    to_json(event.metrics),
                )
                await self._start_round(tx, event.job_id, spec, shards, event.weights, decision.round,
                                        decision.attempt, prefer=event.trained_by)
        await self.outbox.flush()

    async def on_round_failed(self, event: RoundFailed, delivery: Delivery) -> None:
        """A round failed: retry it from the last global weights, or fail the job."""
        async with self._locks(event.job_id):
            current = await self._current(event)
            if current is None:
                return
            job, spec = current
            decision = after_failed(event.round, event.attempt, job["failures"], spec.distributed.fault_tolerance)
            log.warning("job %s: round %d attempt %d failed: %s", event.job_id, event.round, event.attempt,
                        event.reason)
            if decision.next is Next.FAIL:
                reason = (f"round {event.round} failed {decision.failures} time(s) in a row "
                          f"(fault_tolerance={spec.distributed.fault_tolerance}); last: {event.reason}")
                async with self.db.transaction() as tx:
                    await self._close_round(tx, event.job_id, event.round, event.attempt, "failed",
                                            reason=event.reason)
                    await self._fail_tx(tx, event.job_id, reason, event.round)
                await self.outbox.flush()
                return
            shards = _shards(job)
            weights = _weights(job)
            async with self.db.transaction() as tx:
                await self._close_round(tx, event.job_id, event.round, event.attempt, "failed", reason=event.reason)
                await tx.execute("UPDATE jobs SET failures = $2 WHERE job_id = $1", event.job_id, decision.failures)
                await self._start_round(tx, event.job_id, spec, shards, weights, decision.round, decision.attempt)
        await self.outbox.flush()

    async def on_job_cancel(self, event: JobCancelRequested, delivery: Delivery) -> None:
        """Stop a job: no further round starts; results still in flight are ignored."""
        async with self._locks(event.job_id):
            job = await self._job(event.job_id)
            if job is None:
                # Its request has not arrived (or not been handled) yet: remembered for when it does.
                await self.db.execute(
                    "INSERT INTO early_cancels (job_id, reason, received_at) VALUES ($1, $2, $3)"
                    " ON CONFLICT (job_id) DO NOTHING", event.job_id, event.reason, time.time())
                log.info("job %s: cancel received before the job's request; it will not start", event.job_id)
                return
            if JobStatus(job["status"]).terminal:
                return
            async with self.db.transaction() as tx:
                await self._close_running_rounds(tx, event.job_id, "cancelled", event.reason)
                await tx.execute(
                    "UPDATE jobs SET status = $2, reason = $3, updated_at = $4 WHERE job_id = $1",
                    event.job_id, JobStatus.CANCELLED, event.reason, time.time(),
                )
                await self.outbox.add(tx, JobFailed(job_id=event.job_id, reason=event.reason, round=job["round"],
                                                     cancelled=True))
        await self.outbox.flush()

    async def fail_unfinished(self, reason: str) -> list[str]:
        """End every job that has not ended as failed with `reason`; return their ids.

        For a bus that lives in one process (the embedded default): the messages of jobs that an earlier
        process left unfinished died with it, so nothing would ever move those jobs again.
        """
        rows = await self.db.fetch("SELECT job_id FROM jobs WHERE status NOT IN ($1, $2, $3) ORDER BY created_at",
                                   JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)
        ended = []
        for row in rows:
            async with self._locks(row["job_id"]):
                job = await self._job(row["job_id"])
                if job is None or JobStatus(job["status"]).terminal:
                    continue
                async with self.db.transaction() as tx:
                    await self._close_running_rounds(tx, job["job_id"], "failed", reason)
                    await self._fail_tx(tx, job["job_id"], reason, job["round"])
                ended.append(job["job_id"])
        await self.outbox.flush()
        return ended

    async def _finish(self, job: dict[str, Any], spec: JobSpec, event: RoundAggregated) -> None:
        job_id = job["job_id"]
        final_key = keys.final_model(job_id)
        data = await self.storage.get_bytes(event.weights.key)
        await self.storage.put_bytes(final_key, data)
        metrics = dict(event.metrics)
        evaluation_error = None
        with tempfile.TemporaryDirectory(prefix="apiary-eval-") as tmp:
            path = Path(tmp) / "final.safetensors"
            path.write_bytes(data)
            try:
                evaluated = await self.runner.evaluate(spec.module, spec.env(event.round), path,
                                                       timeout=INIT_TIMEOUT)
                metrics.update(evaluated or {})
            except UserCodeError as e:
                evaluation_error = str(e)
                log.warning("job %s: evaluation failed: %s", job_id, e)
        rounds = await self.db.fetch(
            "SELECT round, attempt, status, reason, metrics FROM rounds WHERE job_id = $1 ORDER BY round, attempt",
            job_id,
        )
        history = [{**r, "metrics": from_json(r["metrics"], {})} for r in rounds
                   if (r["round"], r["attempt"]) != (event.round, event.attempt)]
        history.append({"round": event.round, "attempt": event.attempt, "status": "aggregated",
                        "metrics": event.metrics})
        report = {"job_id": job_id, "name": spec.name, "final": metrics, "rounds": history,
                  "evaluation_error": evaluation_error}
        await self.storage.put_bytes(keys.final_metrics(job_id), json.dumps(report, indent=1).encode())
        final_uri = self.storage.uri(final_key)
        async with self.db.transaction() as tx:
            await self._close_round(tx, job_id, event.round, event.attempt, "aggregated",
                                    weights_key=event.weights.key, metrics=event.metrics)
            await tx.execute(
                "UPDATE jobs SET status = $2, final_model = $3, metrics = $4, weights_key = $5,"
                " weights_size = $6, weights_sha256 = $7, reason = $8, updated_at = $9 WHERE job_id = $1",
                job_id, JobStatus.COMPLETED, final_uri, to_json(metrics), event.weights.key,
                event.weights.size, event.weights.sha256, evaluation_error, time.time(),
            )
            await self.outbox.add(tx, JobCompleted(job_id=job_id, rounds_completed=event.round,
                                                   final_model=final_uri, metrics=metrics))
        log.info("job %s completed after %d rounds: %s", job_id, event.round, metrics)
        await self.outbox.flush()

    async def _close_round(self, tx: Executor, job_id: str, round_index: int, attempt: int, status: str,
                           *, reason: str | None = None, weights_key: str | None = None,
                           metrics: dict[str, float] | None = None) -> None:
        row = await tx.fetchrow(
            "SELECT started_at, trace_id, span_id, shards FROM rounds WHERE job_id = $1 AND round = $2"
            " AND attempt = $3 AND status = 'running'",
            job_id, round_index, attempt,
        )
        if row is not None and row["trace_id"]:
            attributes = {"apiary.job_id": job_id, "apiary.round": round_index, "apiary.attempt": attempt,
                          "apiary.shards": len(from_json(row["shards"], [])), "apiary.round.status": status}
            telemetry.recorded_span(f"round {round_index}", int(row["trace_id"], 16), int(row["span_id"], 16),
                                    int(row["started_at"] * 1e9), attributes, error=reason)
        await tx.execute(
            "UPDATE rounds SET status = $4, ended_at = $5, reason = $6, weights_key = $7, metrics = $8"
            " WHERE job_id = $1 AND round = $2 AND attempt = $3",
            job_id, round_index, attempt, status, time.time(), reason, weights_key,
            to_json(metrics) if metrics is not None else None,
        )

    async def _close_running_rounds(self, tx: Executor, job_id: str, status: str, reason: str) -> None:
        """End the job's running round, if any, with `status`: the job ended before the round did."""
        for r in await tx.fetch("SELECT round, attempt FROM rounds WHERE job_id = $1 AND status = 'running'", job_id):
            await self._close_round(tx, job_id, r["round"], r["attempt"], status, reason=reason)

    async def _fail(self, job_id: str, reason: str, round_index: int | None = None) -> None:
        async with self.db.transaction() as tx:
            await self._fail_tx(tx, job_id, reason, round_index)
        await self.outbox.flush()

    async def _fail_tx(self, tx: Executor, job_id: str, reason: str, round_index: int | None) -> None:
        log.error("job %s failed: %s", job_id, reason)
        await tx.execute(
            "UPDATE jobs SET status = $2, reason = $3, updated_at = $4 WHERE job_id = $1",
            job_id, JobStatus.FAILED, reason, time.time(),
        )
        await self.outbox.add(tx, JobFailed(job_id=job_id, reason=reason, round=round_index))

    async def _current(self, event: RoundAggregated | RoundFailed) -> tuple[dict[str, Any], JobSpec] | None:
        """The running job and its spec, if the outcome is for the attempt it runs now (else it is
        late or a duplicate, and ignored)."""
        job = await self._job(event.job_id)
        if job is None or job["status"] != JobStatus.RUNNING:
            return None
        if not is_current(job["round"], job["attempt"], event.round, event.attempt):
            log.info("job %s: late %s for round %d attempt %d ignored", event.job_id, event.routing_key,
                     event.round, event.attempt)
            return None
        return job, JobSpec.model_validate_json(job["spec"])

    async def _job(self, job_id: str) -> dict[str, Any] | None:
        return await self.db.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)


def _shards(job: dict[str, Any]) -> list[ShardInfo]:
    """A job row's shards."""
    return [ShardInfo.model_validate(s) for s in from_json(job["shards"], [])]


def _weights(job: dict[str, Any]) -> ObjectRef:
    """A job row's current global weights."""
    return ObjectRef(key=job["weights_key"], size=job["weights_size"], sha256=job["weights_sha256"])


__all__ = ["Scheduler"]
