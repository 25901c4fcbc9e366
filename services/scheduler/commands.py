"""What the scheduler does on a job's commands: a request (accepted, or rejected naming each bad field),
a cancel (also one that comes before its request), and failing the jobs an earlier process left unfinished."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from pydantic import ValidationError

from apiary import bundle_store
from apiary.bus import Delivery
from apiary.contracts import (
    JobAccepted,
    JobCancelRequested,
    JobFailed,
    JobRejected,
    JobRequested,
    ShardRequested,
    decode_body,
)
from apiary.db import Database
from apiary.jobspec import FieldError, JobSpec, describe_errors, field_errors, policy_errors, strategy_errors
from apiary.outbox import KeyedLocks, Outbox
from apiary.policy import LIMITS, Policy
from apiary.registry import registry_errors
from apiary.status import JobStatus, RoundStatus
from apiary.storage import Storage
from services.scheduler import endings, store

log = logging.getLogger("apiary.scheduler")


class JobCommands:
    """Starts and stops jobs on request; each outcome is stored with the events it causes."""

    def __init__(self, db: Database, storage: Storage, outbox: Outbox, locks: KeyedLocks,
                 policy: Policy | None = None) -> None:
        self._db, self._storage, self._outbox, self._locks = db, storage, outbox, locks
        self._policy = policy or Policy()

    async def on_job_requested(self, delivery: Delivery) -> None:
        """Validate a job request; accept it and ask for shards, or reject it naming each bad field."""
        data = decode_body(delivery.body, delivery.content_type)
        raw_id = data.get("job_id")
        job_id = raw_id if isinstance(raw_id, str) and raw_id else uuid.uuid4().hex[:12]
        if len(delivery.body) > LIMITS.request_bytes:
            await self._reject(job_id, [FieldError(field="(request)", message=(
                f"{len(delivery.body)} bytes, over the limit of {LIMITS.request_bytes}"))])
            return
        try:
            request = JobRequested.model_validate(data)
        except ValidationError as e:
            await self._reject(job_id, field_errors(e))
            return
        spec = JobSpec.model_validate(request.model_dump(exclude={"job_id", "v"}))
        # Off the event loop: the first check imports the strategies (torch) and the privacy accountant, and a
        # privacy budget is checked round by round, so a request stalls no other handler while it is checked.
        if errors := (await asyncio.to_thread(strategy_errors, spec) or policy_errors(spec, self._policy)
                      or await registry_errors(self._storage, spec)):
            await self._reject(job_id, errors)
            return
        # The bundle's member list is read (never imported): its entrypoint module must be there.
        code_errors, spec = await bundle_store.code_errors(self._storage, spec)
        if code_errors:
            await self._reject(job_id, code_errors)
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
                    job_id=job_id, dataset=spec.dataset, dataset_id=_text(spec.dataset_id),
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
                await endings.close_running_rounds(tx, event.job_id, RoundStatus.CANCELLED, event.reason)
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
                    await endings.close_running_rounds(tx, job_id, RoundStatus.FAILED, reason)
                    await endings.fail_job(tx, self._outbox, job_id, reason, job.round)
                ended.append(job_id)
        await self._outbox.flush()
        return ended


def _text(item_id: int | str | None) -> str | None:
    """A registry id as the sharder's messages and tables carry it: text."""
    return None if item_id is None else str(item_id)


def _accepted(job_id: str, spec: JobSpec) -> JobAccepted:
    """The job.accepted event for a job."""
    return JobAccepted(job_id=job_id, name=spec.name, num_rounds=spec.distributed.num_rounds,
                       num_shards=spec.num_shards)


__all__ = ["JobCommands"]
