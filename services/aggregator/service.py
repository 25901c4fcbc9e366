"""Aggregator handlers: round.start, worker.done, round.timeout, job.failed -> round.aggregated / round.failed."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from apiary import keys, telemetry
from apiary.bus import Delivery, EventHandler, subscribe
from apiary.component import Component, from_json, to_json
from apiary.contracts import (
    JobFailed,
    ObjectRef,
    RoundAggregated,
    RoundFailed,
    RoundStart,
    RoundTimeout,
    WorkerDone,
    WorkerFailed,
)
from apiary.outbox import KeyedLocks, Outbox, outbox_migration
from apiary.storage import ObjectNotFound
from apiary.strategies.base import merge_partial, weighted_metrics
from apiary.strategies.validation import InvalidContribution, validate
from apiary.strategies.weighted_sum import WeightedSum as FedAvg
from apiary.weights import WeightsError, WeightSpec, spec_of
from apiary.weights import dumps as dump_weights
from apiary.weights import loads as load_weights

log = logging.getLogger("apiary.aggregator")

MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS aggregations (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL, shards TEXT NOT NULL,
      min_workers BIGINT NOT NULL, weights_key TEXT NOT NULL, weights_size BIGINT NOT NULL,
      weights_sha256 TEXT NOT NULL, use_peft BIGINT NOT NULL, status TEXT NOT NULL,
      result_key TEXT, reason TEXT, opened_at DOUBLE PRECISION NOT NULL, closed_at DOUBLE PRECISION,
      PRIMARY KEY (job_id, round, attempt));
    CREATE TABLE IF NOT EXISTS contributions (
      seq {autoid}, job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL,
      shard BIGINT NOT NULL, worker_id TEXT NOT NULL, status TEXT NOT NULL, reason TEXT,
      samples BIGINT NOT NULL, result_key TEXT NOT NULL, size BIGINT NOT NULL, sha256 TEXT NOT NULL,
      metrics TEXT NOT NULL, received_at DOUBLE PRECISION NOT NULL);
    CREATE UNIQUE INDEX IF NOT EXISTS contributions_once
      ON contributions (job_id, round, attempt, shard) WHERE status IN ('accepted', 'rejected', 'failed');
    CREATE INDEX IF NOT EXISTS contributions_round ON contributions (job_id, round, attempt)
    """,
    outbox_migration("aggregator_outbox"),
    # Trace context: the round's (parent of the aggregation span) and each contribution's (its links).
    "ALTER TABLE aggregations ADD COLUMN traceparent TEXT; ALTER TABLE contributions ADD COLUMN traceparent TEXT",
    # The round's deadline: a last shard settling after it ends the round as a timeout would.
    "ALTER TABLE aggregations ADD COLUMN deadline DOUBLE PRECISION",
]

PREFETCH_MAX_BYTES = 8 * 1024 * 1024

# What a stored contribution can be: counted in the average, refused, the user's code failed, or not
# for this round. The first three settle a shard; the others are recorded and ignored.
ACCEPTED, REJECTED, FAILED = "accepted", "rejected", "failed"
DUPLICATE, LATE, ORPHAN, UNASSIGNED = "duplicate", "late", "orphan", "unassigned"
SETTLED = frozenset({ACCEPTED, REJECTED, FAILED})


SPEC_CACHE = 256  # global weights whose names, dtypes and shapes are remembered


@dataclass
class RoundState:
    """One open round in memory: its row, which shards have settled and the running sum. It is a
    cache of the database and storage: dropped whenever a handler fails, rebuilt from them on next use
    (after a restart too), so a contribution is counted exactly when its row says so."""

    agg: dict[str, Any]
    spec: WeightSpec
    shards: frozenset[int]
    settled: dict[int, str] = field(default_factory=dict)
    fedavg: FedAvg = field(default_factory=FedAvg)
    keys: frozenset[str] | None = None


class Aggregator(Component):
    """Folds each round's contributions into a streaming FedAvg and closes the round once."""

    name = "aggregator"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbox = Outbox(self.db, self.bus, "aggregator_outbox")
        self._locks = KeyedLocks()
        self._rounds: dict[tuple[str, int, int], RoundState] = {}
        self._specs: dict[tuple[str, str], WeightSpec] = {}

    async def start(self) -> None:
        await self.db.migrate(self.name, MIGRATIONS)
        await self.outbox.flush()
        handlers: dict[str, EventHandler] = {
            "round.start": self.on_round_start,
            "worker.done": self.on_worker_done,
            "worker.failed": self.on_worker_failed,
            "round.timeout": self.on_round_timeout,
            "job.failed": self.on_job_ended,
        }
        self._subscriptions.append(
            await subscribe(self.bus, "aggregator", handlers, prefetch=self.settings.prefetch)
        )

    def rounds_in_memory(self) -> list[tuple[str, int, int]]:
        """(job, round, attempt) of each round whose running sum this aggregator holds."""
        return list(self._rounds)

    async def on_round_start(self, event: RoundStart, delivery: Delivery) -> None:
        """Remember which shards a round waits for and the weights it started from."""
        async with self._locks(event.job_id):
            row = {
                "job_id": event.job_id, "round": event.round, "attempt": event.attempt,
                "shards": to_json(event.shards), "min_workers": event.min_workers, "weights_key": event.weights.key,
                "weights_size": event.weights.size, "weights_sha256": event.weights.sha256,
                "use_peft": int(event.use_peft), "status": "open", "opened_at": time.time(),
                "traceparent": telemetry.headers_for().get("traceparent"), "deadline": event.deadline,
            }
            inserted = await self.db.execute(
                "INSERT INTO aggregations (job_id, round, attempt, shards, min_workers, weights_key,"
                " weights_size, weights_sha256, use_peft, status, opened_at, traceparent, deadline)"
                " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) ON CONFLICT DO NOTHING",
                *row.values(),
            )
            spec = self._specs.get((event.weights.key, event.weights.sha256))
            if inserted and spec is not None:
                # A new round whose weights this aggregator wrote: nothing to read back before its results.
                self._rounds[(event.job_id, event.round, event.attempt)] = RoundState(
                    agg={**row, "result_key": None, "reason": None, "closed_at": None}, spec=spec,
                    shards=frozenset(event.shards))

    async def _admit(self, event: WorkerDone | WorkerFailed) -> RoundState | None:
        """The open round this report settles a shard of; None (recorded why) if it settles nothing."""
        state = self._rounds.get((event.job_id, event.round, event.attempt))
        if state is None:
            agg = await self._aggregation(event.job_id, event.round, event.attempt)
            if agg is None:
                await self._record(event, ORPHAN, "no such round")
                return None
            if agg["status"] != "open":
                log.info("job %s: late report for round %d/%d shard %d from %s ignored", event.job_id,
                         event.round, event.attempt, event.shard, event.worker_id)
                await self._record(event, LATE, f"round already {agg['status']}")
                return None
            state = await self._load(agg)
        if event.shard not in state.shards:
            await self._record(event, UNASSIGNED, f"shard {event.shard} is not assigned in this round")
            return None
        reported = state.settled.get(event.shard)
        if reported is not None:
            await self._record(event, DUPLICATE, f"shard {event.shard} already reported ({reported})")
            # A redelivered last report whose first handling failed after it was recorded: the round
            # is still open, so close it now rather than at the timeout.
            await self._maybe_close(state)
            return None
        return state

    async def on_worker_failed(self, event: WorkerFailed, delivery: Delivery) -> None:
        """The user's code failed on a shard: that shard settles without weights."""
        async with self._locks(event.job_id), self._dropping_state_on_error(event):
            state = await self._admit(event)
            if state is None:
                return
            await self._record(event, FAILED, event.error, state)
            await self._maybe_close(state)

    async def on_worker_done(self, event: WorkerDone, delivery: Delivery) -> None:
        """Validate a contribution and fold it in, once; close the round when every shard reported."""
        # Small contributions are fetched before queueing for the job's lock, so many download at
        # once; large ones are fetched one at a time inside it (memory: one accumulator plus one).
        early: bytes | BaseException | None = None
        expected_key = keys.contribution(event.job_id, event.round, event.attempt, event.shard)
        if event.result.key != expected_key:
            # Only the object the assignment's upload URL wrote counts: never any other in the bucket.
            early = ValueError(f"result {event.result.key!r} is not this shard's upload ({expected_key!r})")
        elif event.result.size <= PREFETCH_MAX_BYTES:
            try:
                early = await self.storage.verified_bytes(event.result)
            except (ObjectNotFound, ValueError) as e:
                early = e
        async with self._locks(event.job_id), self._dropping_state_on_error(event):
            state = await self._admit(event)
            if state is None:
                return
            try:
                if isinstance(early, BaseException):
                    raise early
                data = early if early is not None else await self.storage.verified_bytes(event.result)
                weights = load_weights(data, copy=False)
                # Values are checked by the fold, tensor by tensor while each is in cache.
                validate(state.spec, weights, event.samples, partial=bool(state.agg["use_peft"]),
                         expected_keys=state.keys, values=False)
                state.fedavg.fold(weights, event.samples)
            except (ObjectNotFound, InvalidContribution, WeightsError, ValueError) as e:
                reason = f"object {event.result.key} is missing" if isinstance(e, ObjectNotFound) else str(e)
                log.warning("job %s: round %d shard %d from %s rejected: %s", event.job_id, event.round,
                            event.shard, event.worker_id, reason)
                await self._record(event, REJECTED, reason, state)
                if state.fedavg.spoiled:
                    # Part of the refused contribution was added: the exact sum is re-folded from
                    # the accepted contributions in storage.
                    self._rounds.pop((event.job_id, event.round, event.attempt), None)
                    state = await self._load(state.agg)
            else:
                # Should recording fail, the sum holds a contribution the database does not: the
                # state is dropped (below) and rebuilt from the stored rows next time.
                state.keys = frozenset(weights)
                await self._record(event, ACCEPTED, None, state)
            await self._maybe_close(state)

    @contextlib.asynccontextmanager
    async def _dropping_state_on_error(self, event: WorkerDone | WorkerFailed) -> AsyncIterator[None]:
        try:
            yield
        except BaseException:
            self._rounds.pop((event.job_id, event.round, event.attempt), None)
            raise

    async def on_round_timeout(self, event: RoundTimeout, delivery: Delivery) -> None:
        """The round's time is up: aggregate what arrived if enough did, else fail the round."""
        async with self._locks(event.job_id):
            key = (event.job_id, event.round, event.attempt)
            state = self._rounds.get(key)
            if state is None:
                agg = await self._aggregation(*key)
                if agg is None or agg["status"] != "open":
                    return
                state = await self._load(agg)
            try:
                await self._close(state, timed_out=True)
            except BaseException:
                self._rounds.pop(key, None)
                raise

    async def on_job_ended(self, event: JobFailed, delivery: Delivery) -> None:
        """A job was cancelled or failed: its end marker is stored, its open rounds close now and their
        sums are freed (a large model's would otherwise be held until the round's timeout); reports
        still on their way are recorded as late."""
        status = "cancelled" if event.cancelled else "failed"
        # The job's end marker, for workers that start after this event and would otherwise train
        # its assignments still queued (they have only the bus and the URLs in those assignments).
        await self.storage.put_bytes(keys.job_ended(event.job_id), to_json(
            {"job_id": event.job_id, "status": status, "reason": event.reason}).encode())
        async with self._locks(event.job_id):
            closed = await self.db.execute(
                "UPDATE aggregations SET status = $2, reason = $3, closed_at = $4"
                " WHERE job_id = $1 AND status = 'open'",
                event.job_id, status, f"job {status}: {event.reason}", time.time(),
            )
            for key in [k for k in self._rounds if k[0] == event.job_id]:
                del self._rounds[key]
        if closed:
            log.info("job %s %s: its open round closed", event.job_id, status)

    async def _maybe_close(self, state: RoundState) -> None:
        if len(state.settled) >= len(state.shards):
            # A last shard settled after the deadline (a straggler stopped there) ends a round that timed out.
            deadline = state.agg["deadline"]
            await self._close(state, timed_out=deadline is not None and time.time() >= deadline)

    async def _close(self, state: RoundState, *, timed_out: bool) -> None:
        """Aggregate or fail the round, inside one span: a child of the round, linked to every
        contribution folded in."""
        agg = state.agg
        job_id, round_index, attempt = agg["job_id"], agg["round"], agg["attempt"]
        rows = await self._contributions(job_id, round_index, attempt)
        accepted = [r for r in rows if r["status"] == ACCEPTED]
        links = [link for r in accepted if (link := telemetry.link_from({"traceparent": r["traceparent"] or ""}))]
        attributes = {"apiary.job_id": job_id, "apiary.round": round_index, "apiary.attempt": attempt,
                      "apiary.contributions": len(accepted), "apiary.samples": sum(r["samples"] for r in accepted),
                      "apiary.bytes": sum(r["size"] for r in accepted)}
        parent = telemetry.context_from({"traceparent": agg["traceparent"] or ""})
        with telemetry.tracer().start_as_current_span("aggregate", context=parent, links=links,
                                                      attributes=attributes) as span:
            if timed_out:
                span.add_event("round.timeout")
            for r in rows:
                if r["status"] in (REJECTED, FAILED):
                    span.add_event(f"contribution.{r['status']}", {"apiary.shard": r["shard"],
                                                                    "apiary.worker_id": r["worker_id"],
                                                                    "reason": r["reason"] or ""})
            await self._settle(state, rows, accepted, span, timed_out=timed_out)

    async def _settle(self, state: RoundState, rows: list[dict[str, Any]], accepted: list[dict[str, Any]],
                      span: Any, *, timed_out: bool) -> None:
        agg = state.agg
        job_id, round_index, attempt = agg["job_id"], agg["round"], agg["attempt"]
        rejected = {str(r["shard"]): r["reason"] or "" for r in rows if r["status"] in (REJECTED, FAILED)}
        expected = len(state.shards)
        if len(accepted) < agg["min_workers"]:
            why = "timeout" if timed_out else "too few valid contributions"
            reason = (f"{why}: {len(accepted)} of {expected} shards contributed valid weights, "
                      f"min_workers is {agg['min_workers']}")
            if rejected:
                reason += "; " + "; ".join(f"shard {s}: {r}" for s, r in sorted(rejected.items()))
            failed = RoundFailed(job_id=job_id, round=round_index, attempt=attempt, reason=reason,
                                 reported=len(accepted), required=agg["min_workers"])
            telemetry.fail(span, "round.failed", reason)
            async with self.db.transaction() as tx:
                await tx.execute(
                    "UPDATE aggregations SET status = 'failed', reason = $4, closed_at = $5"
                    " WHERE job_id = $1 AND round = $2 AND attempt = $3",
                    job_id, round_index, attempt, reason, time.time(),
                )
                await self.outbox.add(tx, failed)
            self._rounds.pop((job_id, round_index, attempt), None)
            await self.outbox.flush()
            return
        # finish() consumes the sum: should closing fail after it, the retry re-folds from storage.
        self._rounds.pop((job_id, round_index, attempt), None)
        average = state.fedavg.finish()
        if agg["use_peft"]:
            base = load_weights(await self.storage.get_bytes(agg["weights_key"]))
            average = merge_partial(base, average)
        data = dump_weights(average)
        ref = await self.storage.put_bytes(keys.global_weights(job_id, round_index), data)
        self._remember_spec(ref, spec_of(data))
        metrics = weighted_metrics([(r["samples"], from_json(r["metrics"], {})) for r in accepted])
        done = RoundAggregated(
            job_id=job_id, round=round_index, attempt=attempt, weights=ref,
            contributors=sorted(r["shard"] for r in accepted), total_samples=state.fedavg.total_samples,
            metrics=metrics, rejected=rejected, trained_by={r["shard"]: r["worker_id"] for r in accepted},
        )
        async with self.db.transaction() as tx:
            await tx.execute(
                "UPDATE aggregations SET status = 'aggregated', result_key = $4, closed_at = $5"
                " WHERE job_id = $1 AND round = $2 AND attempt = $3",
                job_id, round_index, attempt, ref.key, time.time(),
            )
            await self.outbox.add(tx, done)
        self._rounds.pop((job_id, round_index, attempt), None)
        log.info("job %s: round %d aggregated from %d shards (%d samples)%s", job_id, round_index,
                 len(accepted), done.total_samples, " at timeout" if timed_out else "")
        await self.outbox.flush()

    def _remember_spec(self, ref: ObjectRef, spec: WeightSpec) -> None:
        self._specs[(ref.key, ref.sha256)] = spec
        while len(self._specs) > SPEC_CACHE:
            del self._specs[next(iter(self._specs))]

    async def _load(self, agg: dict[str, Any]) -> RoundState:
        """An open round's state from its rows: the shards settled so far, and the sum re-folded from
        the stored accepted contributions (after a restart, or after a handler failed)."""
        base = ObjectRef(key=agg["weights_key"], size=agg["weights_size"], sha256=agg["weights_sha256"])
        spec = self._specs.get((base.key, base.sha256))
        if spec is None:
            spec = spec_of(await self.storage.get_bytes(base.key))
            self._remember_spec(base, spec)
        key = (agg["job_id"], agg["round"], agg["attempt"])
        state = RoundState(agg=agg, spec=spec, shards=frozenset(from_json(agg["shards"])))
        for row in await self._contributions(*key):
            if row["status"] in SETTLED:
                state.settled[row["shard"]] = row["status"]
            if row["status"] != ACCEPTED:
                continue
            ref = ObjectRef(key=row["result_key"], size=row["size"], sha256=row["sha256"])
            weights = load_weights(await self.storage.verified_bytes(ref), copy=False)
            state.fedavg.fold(weights, row["samples"])
            state.keys = frozenset(weights)
        self._rounds[key] = state
        return state

    async def _aggregation(self, job_id: str, round_index: int, attempt: int) -> dict[str, Any] | None:
        return await self.db.fetchrow(
            "SELECT * FROM aggregations WHERE job_id = $1 AND round = $2 AND attempt = $3",
            job_id, round_index, attempt,
        )

    async def _contributions(self, job_id: str, round_index: int, attempt: int) -> list[dict[str, Any]]:
        return await self.db.fetch(
            "SELECT * FROM contributions WHERE job_id = $1 AND round = $2 AND attempt = $3 ORDER BY seq",
            job_id, round_index, attempt,
        )

    async def _record(self, event: WorkerDone | WorkerFailed, status: str, reason: str | None,
                      state: RoundState | None = None) -> None:
        if isinstance(event, WorkerFailed):
            samples, result, metrics = 0, ObjectRef(key="", size=0, sha256=""), {}
        else:
            samples, result, metrics = event.samples, event.result, event.metrics
        await self.db.execute(
            "INSERT INTO contributions (job_id, round, attempt, shard, worker_id, status, reason, samples,"
            " result_key, size, sha256, metrics, received_at, traceparent)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
            event.job_id, event.round, event.attempt, event.shard, event.worker_id, status, reason,
            samples, result.key, result.size, result.sha256, to_json(metrics), time.time(),
            telemetry.headers_for().get("traceparent"),
        )
        if state is not None and status in SETTLED:
            state.settled[event.shard] = status
