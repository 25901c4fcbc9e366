"""Aggregator handlers: round.start, worker.done, worker.failed, round.timeout, job.failed, job.completed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from apiary import contracts, keys
from apiary.bus import Delivery, EventHandler
from apiary.component import Component, to_json
from apiary.outbox import KeyedLocks, Outbox
from apiary.status import ContributionStatus, RoundStatus
from apiary.storage import ObjectNotFound
from apiary.strategies.base import Contribution
from apiary.strategies.validation import InvalidContribution
from apiary.weights import WeightsError
from apiary.weights import loads as load_weights
from services.aggregator.closing import RoundCloser
from services.aggregator.decisions import (
    Report,
    all_settled,
    ended_status,
    judge_round,
    judge_sender,
    judge_shard,
    past_deadline,
)
from services.aggregator.rounds import PREFETCH_MAX_BYTES, OpenRounds, RoundKey, RoundState
from services.aggregator.store import AggregatorStore, opened_row

log = logging.getLogger("apiary.aggregator")

# How long a report for a round not stored yet waits for its round.start before it is recorded as an orphan.
ROUND_START_WAIT = 10.0


class Aggregator(Component):
    """Takes each round's contributions into its strategy as they arrive and closes the round once."""

    name = "aggregator"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbox = Outbox(self.db, self.bus, "aggregator_outbox")
        self.store = AggregatorStore(self.db)
        self._locks = KeyedLocks()
        self._rounds = OpenRounds(self.store, self.storage)
        self._closer = RoundCloser(self.store, self.storage, self.outbox, self._rounds)

    async def start(self) -> None:
        await self.store.migrate(self.name)
        await self.outbox.flush()
        handlers: dict[str, EventHandler] = {
            "round.start": self.on_round_start,
            "worker.done": self.on_worker_done,
            "worker.failed": self.on_worker_failed,
            "round.timeout": self.on_round_timeout,
            "job.failed": self.on_job_ended,
            "job.completed": self.on_job_ended,
        }
        await self.consume("aggregator", handlers)

    async def stop(self) -> None:
        """Stop consuming, then the outbox's background flush (its events stay stored)."""
        await super().stop()
        await self._rounds.recorder.close()
        await self.outbox.close()

    def rounds_in_memory(self) -> list[tuple[str, int, int]]:
        """(job, round, attempt) of each round whose running state this aggregator holds."""
        return self._rounds.keys()

    async def on_round_start(self, event: contracts.RoundStart, delivery: Delivery) -> None:
        """Remember which shards a round waits for, the weights it started from and its strategy."""
        async with self._locks(event.job_id):
            row = opened_row(event)
            inserted = await self.store.open_round(row)
            spec = self._rounds.known_spec(event.weights)
            if inserted and spec is not None:
                # A new round whose weights this aggregator wrote: nothing to read back before its results.
                await self._rounds.begin(row, spec)

    async def on_worker_failed(self, event: contracts.WorkerFailed, delivery: Delivery) -> None:
        """The user's code failed on a shard: that shard settles without weights."""
        await self._round_started(event)
        async with self._locks(event.job_id), self._dropping_state_on_error(event):
            state = await self._admit(event, delivery)
            if state is None:
                return
            await self._maybe_close(state, await self._record(event, ContributionStatus.FAILED, event.error, state))

    async def on_worker_done(self, event: contracts.WorkerDone, delivery: Delivery) -> None:
        """Validate a contribution and take it in, once; close the round when every shard reported."""
        early, _ = await asyncio.gather(self._prefetch(event), self._round_started(event))
        async with self._locks(event.job_id), self._dropping_state_on_error(event):
            state = await self._admit(event, delivery)
            if state is None:
                return
            try:
                if isinstance(early, BaseException):
                    raise early
                data = early if early is not None else await self.storage.verified_bytes(event.result)
                weights = load_weights(data, copy=False)
                state.strategy.accept(Contribution(weights, event.samples, event.metrics))
            except (ObjectNotFound, InvalidContribution, WeightsError, ValueError) as e:
                state, settled = await self._reject(event, state, e)
                await self._maybe_close(state, settled)
                return
            # Recorded with the round's other reports taken in meanwhile (group commit), outside the lock; should
            # that fail, the recorder drops the state, whose sum holds it, to be rebuilt from the stored rows.
            committed = self._rounds.recorder.add(state.key, event)
            state.settled[event.shard] = ContributionStatus.ACCEPTED
        settled = await asyncio.shield(committed)  # shared by the group: one handler cancelled cancels no other
        async with self._locks(event.job_id), self._dropping_state_on_error(event):
            held = self._rounds.get(state.key) or await self._still_open(state.key)
            if held is not None:
                await self._maybe_close(held, settled)

    async def _still_open(self, key: RoundKey) -> RoundState | None:
        """An open round's state, rebuilt from its rows (a failed handler dropped it); None once it is closed."""
        agg = await self.store.aggregation(*key)
        if agg is None or judge_round(agg) is not None:
            return None
        return await self._rounds.load(agg)

    async def _round_started(self, event: Report) -> None:
        """Wait, outside the job's lock, until the report's round is stored (at most ROUND_START_WAIT s): with
        aggregator replicas a report can overtake its round's round.start, which another replica is still handling
        (it waits for that job's lock there, say, behind the close of the round before). A round still missing
        then never started: `_admit` records the report as an orphan."""
        key = (event.job_id, event.round, event.attempt)
        if self._rounds.get(key) is not None:
            return
        deadline, pause = time.monotonic() + ROUND_START_WAIT, 0.02
        while await self.store.aggregation(*key) is None and time.monotonic() < deadline:
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.5)

    async def _prefetch(self, event: contracts.WorkerDone) -> bytes | BaseException | None:
        """Small contributions are fetched before queueing for the job's lock, so many download at
        once; large ones (None here) are fetched one at a time inside it (memory: one accumulator plus one)."""
        if event.result.key != keys.contribution(event.job_id, event.round, event.attempt, event.shard):
            return None  # another object than the shard's upload: _admit records the report as forged
        if event.result.size > PREFETCH_MAX_BYTES:
            return None
        try:
            return await self.storage.verified_bytes(event.result)
        except (ObjectNotFound, ValueError) as e:
            return e

    async def _reject(self, event: contracts.WorkerDone, state: RoundState,
                      error: Exception) -> tuple[RoundState, int | None]:
        """Record a refused contribution; the round's state, re-folded if the refusal spoiled it, and how many
        of its shards have settled now."""
        reason = f"object {event.result.key} is missing" if isinstance(error, ObjectNotFound) else str(error)
        log.warning("job %s: round %d shard %d from %s rejected: %s", event.job_id, event.round,
                    event.shard, event.worker_id, reason)
        settled = await self._record(event, ContributionStatus.REJECTED, reason, state)
        if not state.strategy.spoiled:
            return state, settled
        # Part of the refused contribution was taken in: the exact state is re-folded from the
        # accepted contributions in storage.
        self._rounds.drop(state.key)
        return await self._rounds.load(state.agg), settled

    async def _admit(self, event: Report, delivery: Delivery) -> RoundState | None:
        """The open round this report settles a shard of; None (recorded why) if it settles nothing: it
        is an orphan, late, forged (it never takes the genuine report's place), unassigned or a duplicate."""
        key = (event.job_id, event.round, event.attempt)
        state = self._rounds.get(key)
        if state is None:
            agg = await self.store.aggregation(*key)
            verdict = judge_round(agg)
            if verdict is not None:
                if verdict.status is ContributionStatus.LATE:
                    log.info("job %s: late report for round %d/%d shard %d from %s ignored", event.job_id,
                             event.round, event.attempt, event.shard, event.worker_id)
                await self._record(event, verdict.status, verdict.reason)
                return None
            assert agg is not None  # judge_round calls a missing round an orphan
            state = await self._rounds.load(agg)
        forged = judge_sender(event, state.agg, delivery.user_id)
        if forged is not None:
            log.warning("job %s: round %d shard %d: report from %s is forged: %s", event.job_id, event.round,
                        event.shard, event.worker_id, forged.reason)
            await self._record(event, forged.status, forged.reason)
            return None
        verdict = judge_shard(event.shard, state.shards, state.settled)
        if verdict is None:
            return state
        await self._record(event, verdict.status, verdict.reason)
        if verdict.status is ContributionStatus.DUPLICATE:
            # A redelivered last report whose first handling failed after it was recorded: the round
            # is still open, so close it now rather than at the timeout.
            await self._maybe_close(state)
        return None

    @contextlib.asynccontextmanager
    async def _dropping_state_on_error(self, event: Report) -> AsyncIterator[None]:
        try:
            yield
        except BaseException:
            self._rounds.drop((event.job_id, event.round, event.attempt))
            raise

    async def on_round_timeout(self, event: contracts.RoundTimeout, delivery: Delivery) -> None:
        """The round's time is up: aggregate what arrived if enough did, else fail the round."""
        async with self._locks(event.job_id):
            key = (event.job_id, event.round, event.attempt)
            state = self._rounds.get(key)
            if state is None:
                agg = await self.store.aggregation(*key)
                if agg is None or judge_round(agg) is not None:
                    return
                state = await self._rounds.load(agg)
            try:
                await self._closer.close(state, timed_out=True)
            except BaseException:
                self._rounds.drop(key)
                raise

    async def on_job_ended(self, event: contracts.JobFailed | contracts.JobCompleted, delivery: Delivery) -> None:
        """A job was cancelled, failed or completed (early stopping ends one while its next round runs): its
        end marker is stored, its open rounds close now as cancelled or failed, nothing of them aggregated,
        and their state is freed (a large model's would otherwise be held until the round's timeout);
        reports still on their way are recorded as late."""
        if isinstance(event, contracts.JobCompleted):
            status, ended, reason = RoundStatus.CANCELLED, "completed", event.reason or "completed"
        else:
            status = ended_status(event.cancelled)
            ended, reason = str(status), event.reason
        # The job's end marker, for workers that start after this event and would otherwise train
        # its assignments still queued (they have only the bus and the URLs in those assignments).
        await self.storage.put_bytes(keys.job_ended(event.job_id), to_json(
            {"job_id": event.job_id, "status": ended, "reason": reason}).encode())
        async with self._locks(event.job_id):
            closed = await self.store.end_job(event.job_id, status, f"job {ended}: {reason}")
            self._rounds.drop_job(event.job_id)
        if closed:
            log.info("job %s %s: its open round closed", event.job_id, ended)

    async def _maybe_close(self, state: RoundState, settled: int | None = None) -> None:
        """Close the round if every shard has settled: here, or by any replica (`settled`, as counted when this
        one recorded its report, or read now): another aggregator replica may have settled the shards this
        one has not seen, and the one whose report settles the last shard counts them all."""
        if not all_settled(state.settled, state.shards):
            if settled is None:
                settled = await self.store.settled_shards(*state.key)
            if settled < len(state.shards):
                return
        # A last shard settled after the deadline (a straggler stopped there) ends a round that timed out.
        await self._closer.close(state, timed_out=past_deadline(state.agg["deadline"], time.time()))

    async def _record(self, event: Report, status: ContributionStatus, reason: str | None,
                      state: RoundState | None = None) -> int | None:
        """Store a report; for one that settles its shard, how many of the round's shards have settled."""
        settled = await self.store.record(event, status, reason)
        if state is not None and status.settles:
            state.settled[event.shard] = status
        return settled

