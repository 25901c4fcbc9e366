"""Mode async (FedBuff): each version of a job is a round whose aggregations row is the version's buffer. Any
training task's update folds into the job's open version as it arrives, weighted by its samples and staleness
(apiary.strategies.buffered); at `buffer_size` updates the version is stored and announced (`round.aggregated`)
and the next one opens in the same transaction, so no update waits for a round barrier.

The guarantees are a synchronous round's: a task's report settles once (its contributions row, under the same
unique index, commits with its fold row), a forged report (wrong object, secret or sender) never enters, and the
buffer is a cache of its fold rows: a restarted aggregator re-folds them in stored order into the same sum, so
the versions it makes are those an undisturbed run makes from the same arrivals. Memory: the inner strategy's
accumulator, the version's start, one update and the version it started from, whatever the buffer size."""

from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from apiary import keys, metrics, proof, telemetry
from apiary.backoff import Backoff, poll
from apiary.component import from_json, to_json
from apiary.contracts import (
    FoldedUpdate,
    ObjectRef,
    RoundAggregated,
    RoundAssigned,
    RoundFailed,
    RoundStart,
    RoundTimeout,
    WorkerDone,
    WorkerFailed,
)
from apiary.db import Executor
from apiary.jobspec_async import AsyncConfig
from apiary.outbox import Outbox
from apiary.status import ContributionStatus, RoundStatus
from apiary.storage import ObjectNotFound, Storage
from apiary.strategies.base import Contribution
from apiary.strategies.buffered import Buffer, inner_strategy
from apiary.strategies.validation import InvalidContribution
from apiary.weights import WeightsError, spec_of_tensors
from apiary.weights import dumps as dump_weights
from apiary.weights import loads as load_weights
from services.aggregator.decisions import Verdict, update_format
from services.aggregator.store import COLUMNS, AggregatorStore, contribution_row, opened_row

log = logging.getLogger("apiary.aggregator")

COMPONENT = "aggregator_async"
# Append only, as every component's migrations.
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS async_jobs (
      job_id TEXT PRIMARY KEY, settings TEXT NOT NULL, num_rounds BIGINT NOT NULL);
    -- Each training task handed out (round.assigned): the weights it starts from and its secret's digest.
    CREATE TABLE IF NOT EXISTS async_tasks (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL, shard BIGINT NOT NULL,
      weights_key TEXT NOT NULL, weights_size BIGINT NOT NULL, weights_sha256 TEXT NOT NULL,
      secret_digest TEXT NOT NULL, PRIMARY KEY (job_id, round, attempt, shard));
    -- Each update a version's buffer folded, in folding order (seq): the buffer is re-folded from these.
    CREATE TABLE IF NOT EXISTS async_folds (
      seq {autoid}, job_id TEXT NOT NULL, version BIGINT NOT NULL, version_attempt BIGINT NOT NULL,
      round BIGINT NOT NULL, attempt BIGINT NOT NULL, shard BIGINT NOT NULL, worker_id TEXT NOT NULL,
      staleness BIGINT NOT NULL, weight DOUBLE PRECISION NOT NULL, samples BIGINT NOT NULL,
      result_key TEXT NOT NULL, size BIGINT NOT NULL, sha256 TEXT NOT NULL, metrics TEXT NOT NULL,
      duration DOUBLE PRECISION NOT NULL, traceparent TEXT, folded_at DOUBLE PRECISION NOT NULL);
    CREATE UNIQUE INDEX IF NOT EXISTS async_folds_once ON async_folds (job_id, round, attempt, shard);
    CREATE INDEX IF NOT EXISTS async_folds_version ON async_folds (job_id, version, version_attempt);
    """,
]

_SETTLING = ("INSERT INTO contributions (job_id, round, attempt, shard, worker_id, status, reason, samples,"
             " result_key, size, sha256, metrics, received_at, traceparent)"
             " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)")
_ONCE = (" ON CONFLICT (job_id, round, attempt, shard) WHERE status IN ('accepted', 'rejected', 'failed')"
         " DO NOTHING")
_FOLD = ("INSERT INTO async_folds (job_id, version, version_attempt, round, attempt, shard, worker_id, staleness,"
         " weight, samples, result_key, size, sha256, metrics, duration, traceparent, folded_at)"
         " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)")
TASK_WAIT = 10.0  # how long a report waits for its task's round.assigned (it may overtake it) before it is an orphan
TASK_POLL = Backoff(base=0.02, cap=0.5)
STARTS_CACHED = 4  # start versions of arriving updates kept in memory (most updates start from the last few)

Report = WorkerDone | WorkerFailed
VersionKey = tuple[str, int, int]  # (job, version, attempt)


@dataclass
class OpenVersion:
    """A job's open version in memory: its row, settings and buffer; a cache of its fold rows."""

    key: VersionKey
    row: dict[str, Any]
    settings: AsyncConfig
    num_rounds: int
    buffer: Buffer
    current: dict[str, torch.Tensor]
    folded: list[FoldedUpdate] = field(default_factory=list)


class AsyncBuffers:
    """The open versions of async jobs, and what each report, timeout and flush does to them."""

    def __init__(self, store: AggregatorStore, storage: Storage, outbox: Outbox) -> None:
        self._store, self._db, self._storage, self._outbox = store, store.db, storage, outbox
        self._open: dict[str, OpenVersion] = {}
        self._jobs: dict[str, tuple[AsyncConfig, int]] = {}
        self._starts: collections.OrderedDict[str, dict[str, torch.Tensor]] = collections.OrderedDict()

    async def migrate(self) -> None:
        """Create or update the async tables."""
        await self._db.migrate(COMPONENT, MIGRATIONS)

    # ------------------------------------------------------------ which jobs are async

    async def owns(self, job_id: str) -> bool:
        """Whether the job runs in mode async (its first round.start said so)."""
        return await self._job(job_id) is not None

    async def _job(self, job_id: str) -> tuple[AsyncConfig, int] | None:
        known = self._jobs.get(job_id)
        if known is not None:
            return known
        row = await self._db.fetchrow("SELECT settings, num_rounds FROM async_jobs WHERE job_id = $1", job_id)
        if row is None:
            return None
        known = self._jobs[job_id] = (AsyncConfig.model_validate_json(row["settings"]), int(row["num_rounds"]))
        return known

    # ------------------------------------------------------------ events

    async def on_round_start(self, event: RoundStart) -> None:
        """A version opens (the first, or a retry after a failed one): store it, and the job's settings. A version
        the aggregator opened itself at the previous flush keeps its row (and its trace)."""
        assert event.asynchronous is not None
        settings = event.asynchronous.model_dump_json()
        await self._db.execute("INSERT INTO async_jobs (job_id, settings, num_rounds) VALUES ($1, $2, $3)"
                               " ON CONFLICT DO NOTHING", event.job_id, settings, event.num_rounds)
        await self._store.open_round(opened_row(event))
        current = self._open.get(event.job_id)
        if current is not None and current.key < (event.job_id, event.round, event.attempt):
            self._open.pop(event.job_id, None)  # a retry replaces a failed version: recovered from its row

    async def on_assigned(self, event: RoundAssigned) -> None:
        """A training task was handed out: remember what its report must prove, and where it started."""
        await self._db.execute(
            "INSERT INTO async_tasks (job_id, round, attempt, shard, weights_key, weights_size, weights_sha256,"
            " secret_digest) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
            event.job_id, event.round, event.attempt, event.shard, event.weights.key, event.weights.size,
            event.weights.sha256, event.secret_digest)

    async def task_known(self, event: Report) -> None:
        """Wait, outside the job's lock, until the report's task is stored (at most TASK_WAIT s): a report may
        overtake its round.assigned on another queue."""
        async def stored() -> bool:
            return await self._task(event) is not None
        await poll(stored, TASK_POLL, TASK_WAIT)

    async def on_report(self, event: Report, user_id: str | None) -> None:
        """A task's report (under the job's lock): judged, then folded into the open version (or recorded as
        refused, failed, late, forged, a duplicate or an orphan, once); the version closes at buffer_size."""
        verdict = await self._judge(event, user_id)
        if verdict is not None:
            await self._record(event, verdict.status, verdict.reason)
            if verdict.status is ContributionStatus.DUPLICATE:
                # A redelivered last update whose first handling stopped after its fold committed (a crash mid-flush,
                # say): its version is full, so it is made now rather than at the timeout.
                version = await self._current(event.job_id)
                if version is not None and version.buffer.count >= version.settings.k:
                    await self._flush(version, timed_out=False)
            return
        version = await self._current(event.job_id)
        if version is None:
            await self._record(event, ContributionStatus.LATE, "the job has no open version")
            return
        if isinstance(event, WorkerFailed):
            await self._settle(event, ContributionStatus.FAILED, event.error)
            await self._fail_if_failing(version, event.error)
            return
        staleness = version.key[1] - event.round
        limit = version.settings.max_staleness
        if staleness < 0:
            await self._record(event, ContributionStatus.UNASSIGNED, f"task of round {event.round} is newer than "
                               f"the open version {version.key[1]}")
            return
        if limit is not None and staleness > limit:
            await self._settle(event, ContributionStatus.REJECTED, f"stale: trained from version {event.round - 1}"
                               f", {staleness} versions old, max_staleness is {limit}")
            return
        task = await self._task(event)
        assert task is not None  # _judge found it
        try:
            data = await self._storage.verified_bytes(event.result)
            start = await self._start_weights(task)
            weight = version.buffer.accept(Contribution(load_weights(data, copy=False), event.samples,
                                                        event.metrics), start, staleness)
        except (ObjectNotFound, InvalidContribution, WeightsError, ValueError) as e:
            reason = f"object {event.result.key} is missing" if isinstance(e, ObjectNotFound) else str(e)
            if version.buffer.spoiled:
                self._open.pop(event.job_id, None)
            await self._settle(event, ContributionStatus.REJECTED, reason)
            return
        except BaseException:
            self._open.pop(event.job_id, None)  # the sum is unknown: re-folded from the rows when next used
            raise
        folded = FoldedUpdate(shard=event.shard, round=event.round, attempt=event.attempt,
                              worker_id=event.worker_id, samples=event.samples, staleness=staleness, weight=weight,
                              duration_s=event.duration_s)
        try:
            stored = await self._store_fold(version, event, folded)
        except BaseException:
            self._open.pop(event.job_id, None)
            raise
        if not stored:  # another replica settled it meanwhile: this fold must not count
            self._open.pop(event.job_id, None)
            return
        version.folded.append(folded)
        metrics.contribution(ContributionStatus.ACCEPTED)
        if version.buffer.count >= version.settings.k:
            await self._flush(version, timed_out=False)

    async def on_timeout(self, event: RoundTimeout) -> None:
        """A version's time is up (under the job's lock): what its buffer holds makes the version, or, empty,
        the version fails (the scheduler hands its shards out again, within fault_tolerance)."""
        version = await self._current(event.job_id)
        if version is None or version.key != (event.job_id, event.round, event.attempt):
            return
        if version.buffer.count:
            await self._flush(version, timed_out=True)
            return
        await self._fail(version, f"timeout: no update arrived for version {event.round}")

    async def _fail_if_failing(self, version: OpenVersion, error: str) -> None:
        """A version with nothing folded yet fails once as many tasks failed during it as train at once (the user's
        code fails everywhere, say): the scheduler retries it or fails the job (fault_tolerance), rather than
        handing failing tasks out until the version's timeout."""
        if version.buffer.count:
            return
        failed = await self._db.fetchval(
            "SELECT COUNT(*) FROM contributions WHERE job_id = $1 AND status = $2 AND received_at >= $3",
            version.key[0], str(ContributionStatus.FAILED), float(version.row["opened_at"]))
        if int(failed or 0) < version.settings.slots:
            return
        await self._fail(version, f"{failed} training tasks failed and none succeeded; the last: {error}")

    async def _fail(self, version: OpenVersion, reason: str) -> None:
        job_id, index, attempt = version.key
        failed = RoundFailed(job_id=job_id, round=index, attempt=attempt, reason=reason, reported=0,
                             required=version.settings.k)
        async with self._db.transaction() as tx:
            if await self._store.close(tx, version.key, RoundStatus.FAILED, reason=reason):
                await self._outbox.add(tx, failed)
        self._open.pop(job_id, None)
        await self._outbox.flush()

    def drop_job(self, job_id: str) -> None:
        """Forget a job that ended."""
        self._open.pop(job_id, None)

    # ------------------------------------------------------------ judging and recording

    async def _task(self, event: Report) -> dict[str, Any] | None:
        return await self._db.fetchrow(
            "SELECT * FROM async_tasks WHERE job_id = $1 AND round = $2 AND attempt = $3 AND shard = $4",
            event.job_id, event.round, event.attempt, event.shard)

    async def _judge(self, event: Report, user_id: str | None) -> Verdict | None:
        """Why the report settles nothing (forged, an orphan, a duplicate), or None."""
        if isinstance(event, WorkerDone):
            expected = keys.contribution(event.job_id, event.round, event.attempt, event.shard)
            if event.result.key != expected:
                return Verdict(ContributionStatus.FORGED,
                               f"result {event.result.key!r} is not this task's upload ({expected!r})")
        task = await self._task(event)
        if task is None:
            return Verdict(ContributionStatus.ORPHAN, "no such task")
        reason = proof.judge(event.worker_id, user_id, event.secret, task["secret_digest"],
                             about=f"shard {event.shard}")
        if reason is not None:
            return Verdict(ContributionStatus.FORGED, reason)
        settled = await self._db.fetchval(
            "SELECT status FROM contributions WHERE job_id = $1 AND round = $2 AND attempt = $3 AND shard = $4"
            " AND status IN ('accepted', 'rejected', 'failed') LIMIT 1",
            event.job_id, event.round, event.attempt, event.shard)
        if settled is not None:
            return Verdict(ContributionStatus.DUPLICATE, f"task already reported ({settled})")
        return None

    async def _record(self, event: Report, status: ContributionStatus, reason: str) -> None:
        """Store a report that settles nothing."""
        await self._db.execute(_SETTLING, *contribution_row(event, status, reason))
        metrics.contribution(status)

    async def _settle(self, event: Report, status: ContributionStatus, reason: str | None) -> None:
        """Store a report that settles its task without weights (once)."""
        if not await self._db.execute(_SETTLING + _ONCE, *contribution_row(event, status, reason)):
            await self._record(event, ContributionStatus.DUPLICATE, "task already reported")
            return
        metrics.contribution(status)

    async def _store_fold(self, version: OpenVersion, event: WorkerDone, folded: FoldedUpdate) -> bool:
        """The report's contributions row and its fold row, in one transaction; False if the task had settled."""
        row = contribution_row(event, ContributionStatus.ACCEPTED, None)
        async with self._db.transaction() as tx:
            if not await tx.execute(_SETTLING + _ONCE, *row):
                stored = False
            else:
                await tx.execute(_FOLD, event.job_id, version.key[1], version.key[2], event.round, event.attempt,
                                 event.shard, event.worker_id, folded.staleness, folded.weight, event.samples,
                                 event.result.key, event.result.size, event.result.sha256, to_json(event.metrics),
                                 event.duration_s, row[-1], time.time())
                stored = True
        if not stored:
            await self._record(event, ContributionStatus.DUPLICATE, "task already reported by another replica")
        return stored

    # ------------------------------------------------------------ the open version

    async def _current(self, job_id: str) -> OpenVersion | None:
        """The job's open version: held, or recovered from its rows (its fold rows re-folded in stored order)."""
        held = self._open.get(job_id)
        if held is not None and not held.buffer.spoiled:
            return held
        self._open.pop(job_id, None)
        job = await self._job(job_id)
        row = await self._db.fetchrow("SELECT * FROM aggregations WHERE job_id = $1 AND status = $2"
                                      " ORDER BY round DESC, attempt DESC LIMIT 1", job_id, str(RoundStatus.OPEN))
        if job is None or row is None:
            return None
        settings, num_rounds = job
        current = load_weights(await self._storage.get_bytes(row["weights_key"]))
        version = self._begin(row, settings, num_rounds, current)
        state_key = await self._store.previous_state_key(job_id, row["round"])
        if state_key is not None:
            version.buffer.load_state(load_weights(await self._storage.get_bytes(state_key)))
        folds = await self._db.fetch("SELECT * FROM async_folds WHERE job_id = $1 AND version = $2"
                                     " AND version_attempt = $3 ORDER BY seq", job_id, row["round"], row["attempt"])
        for fold in folds:
            task = await self._task_row(job_id, fold)
            data = await self._storage.verified_bytes(ObjectRef(key=fold["result_key"], size=fold["size"],
                                                                sha256=fold["sha256"]))
            version.buffer.accept(Contribution(load_weights(data, copy=False), fold["samples"],
                                               from_json(fold["metrics"], {})),
                                  await self._start_weights(task), int(fold["staleness"]))
            version.folded.append(FoldedUpdate(shard=fold["shard"], round=fold["round"], attempt=fold["attempt"],
                                               worker_id=fold["worker_id"], samples=fold["samples"],
                                               staleness=fold["staleness"], weight=fold["weight"],
                                               duration_s=fold["duration"]))
        if folds:
            log.info("job %s: version %d's buffer recovered: %d updates re-folded", job_id, row["round"], len(folds))
        self._open[job_id] = version
        return version

    async def _task_row(self, job_id: str, fold: dict[str, Any]) -> dict[str, Any]:
        row = await self._db.fetchrow(
            "SELECT * FROM async_tasks WHERE job_id = $1 AND round = $2 AND attempt = $3 AND shard = $4",
            job_id, fold["round"], fold["attempt"], fold["shard"])
        if row is None:
            raise ValueError(f"job {job_id}: fold of task {fold['round']}/{fold['attempt']} has no task row")
        return row

    def _begin(self, row: dict[str, Any], settings: AsyncConfig, num_rounds: int,
               current: dict[str, torch.Tensor]) -> OpenVersion:
        """A version's state with nothing folded yet, from its row and the weights it starts from."""
        buffer = Buffer(inner_strategy(row["strategy"], from_json(row["strategy_params"]), settings), settings)
        buffer.begin(spec_of_tensors(current), update_format(row), current)
        return OpenVersion(key=(row["job_id"], row["round"], row["attempt"]), row=row, settings=settings,
                           num_rounds=num_rounds, buffer=buffer, current=current)

    async def _start_weights(self, task: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The weights a task trained from (a few recent ones kept)."""
        key = task["weights_key"]
        cached = self._starts.get(key)
        if cached is not None:
            self._starts.move_to_end(key)
            return cached
        ref = ObjectRef(key=key, size=task["weights_size"], sha256=task["weights_sha256"])
        weights = load_weights(await self._storage.verified_bytes(ref))
        self._starts[key] = weights
        while len(self._starts) > STARTS_CACHED:
            self._starts.popitem(last=False)
        return weights

    # ------------------------------------------------------------ making a version

    async def _flush(self, version: OpenVersion, *, timed_out: bool) -> None:
        """Store the version made from the buffer, close its row, open the next one (unless it was the last) and
        announce it, in one transaction; inside the version's trace, linked to every update folded."""
        job_id, index, attempt = version.key
        started = time.perf_counter()
        self._open.pop(job_id, None)  # finish() consumes the buffer: a failed flush re-folds from the rows
        folds = await self._db.fetch("SELECT traceparent, size FROM async_folds WHERE job_id = $1 AND version = $2"
                                     " AND version_attempt = $3 ORDER BY seq", job_id, index, attempt)
        links = [link for r in folds if (link := telemetry.link_from({"traceparent": r["traceparent"] or ""}))]
        staleness = [u.staleness for u in version.folded]
        attributes: dict[str, str | int] = {"apiary.job_id": job_id, "apiary.round": index, "apiary.attempt": attempt,
                      "apiary.version": index, "apiary.contributions": len(version.folded),
                      "apiary.samples": sum(u.samples for u in version.folded),
                      "apiary.staleness_max": max(staleness, default=0)}
        parent = telemetry.context_from({"traceparent": version.row["traceparent"] or ""})
        with telemetry.tracer().start_as_current_span("aggregate", context=parent, links=links,
                                                      attributes=attributes) as span:
            if timed_out:
                span.add_event("round.timeout")
            result = version.buffer.finish()
            data = dump_weights(result.weights)
            server_state = version.buffer.state()
            state_key = keys.strategy_state(job_id, index) if server_state else None
            last = index >= version.num_rounds
            async with self._db.transaction() as tx:
                if not await self._store.close(tx, version.key, RoundStatus.AGGREGATED,
                                               result_key=keys.global_weights(job_id, index), state_key=state_key):
                    log.info("job %s: version %d was closed by another aggregator replica", job_id, index)
                    return
                ref = await self._storage.put_bytes(keys.global_weights(job_id, index), data)
                if state_key is not None:
                    await self._storage.put_bytes(state_key, dump_weights(server_state))
                traceparent = None if last else telemetry.headers_for(telemetry.round_context(
                    *telemetry.new_round_ids())).get("traceparent")
                if not last:
                    await self._open_next(tx, version, ref, traceparent)
                await self._outbox.add(tx, RoundAggregated(
                    job_id=job_id, round=index, attempt=attempt, weights=ref,
                    contributors=[u.shard for u in version.folded], total_samples=result.total_samples,
                    metrics=result.metrics, trained_by={u.shard: u.worker_id for u in version.folded},
                    folded=version.folded, next_traceparent=traceparent))
        log.info("job %s: version %d made from %d updates (staleness %s)%s", job_id, index, len(version.folded),
                 staleness, " at timeout" if timed_out else "")
        if not last:
            self._open[job_id] = self._next_version(version, ref, result.weights, server_state, traceparent)
            self._starts[ref.key] = result.weights  # the next tasks start from it
        await self._outbox.flush()
        metrics.aggregated(time.perf_counter() - started, sum(int(r["size"]) for r in folds))

    @staticmethod
    async def _open_next(tx: Executor, version: OpenVersion, ref: ObjectRef, traceparent: str | None) -> None:
        """The next version's row, opened with the flush, in a trace of its own (its round span's ids go to the
        scheduler on round.aggregated)."""
        row = dict(version.row)
        lifetime = float(row["deadline"]) - float(row["opened_at"])
        now = time.time()
        row.update({"round": row["round"] + 1, "attempt": 1, "weights_key": ref.key, "weights_size": ref.size,
                    "weights_sha256": ref.sha256, "status": str(RoundStatus.OPEN), "opened_at": now,
                    "deadline": now + lifetime, "traceparent": traceparent, "secret_digests": json.dumps({})})
        values = [row[c] for c in COLUMNS]
        placeholders = ", ".join(f"${i}" for i in range(1, len(COLUMNS) + 1))
        await tx.execute(f"INSERT INTO aggregations ({', '.join(COLUMNS)}) VALUES ({placeholders})"
                         " ON CONFLICT DO NOTHING", *values)

    def _next_version(self, version: OpenVersion, ref: ObjectRef, weights: dict[str, torch.Tensor],
                      server_state: dict[str, torch.Tensor], traceparent: str | None) -> OpenVersion:
        """The next version's state, begun from the weights just made and the optimiser state just stored."""
        row = dict(version.row)
        row.update({"round": row["round"] + 1, "attempt": 1, "weights_key": ref.key, "weights_size": ref.size,
                    "weights_sha256": ref.sha256, "traceparent": traceparent})
        nxt = self._begin(row, version.settings, version.num_rounds, weights)
        if server_state:
            nxt.buffer.load_state(server_state)
        return nxt
