"""Aggregator handlers: round.start, worker.done, worker.failed, round.timeout, job.failed, job.completed."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from apiary import contracts, keys, metrics
from apiary.backoff import Backoff, poll
from apiary.bus import Delivery, EventHandler
from apiary.component import Component, to_json
from apiary.jobspec import SCAFFOLD
from apiary.outbox import KeyedLocks, Outbox
from apiary.status import ContributionStatus, RoundStatus
from apiary.storage import ObjectNotFound
from apiary.strategies.base import Contribution
from apiary.strategies.validation import InvalidContribution
from apiary.weights import WeightsError
from services.aggregator import shard_states
from services.aggregator.buffers import AsyncBuffers
from services.aggregator.closing import RoundCloser
from services.aggregator.decisions import (
    Report,
    Verdict,
    all_settled,
    ended_status,
    judge_sender,
    judge_shard,
    past_deadline,
)
from services.aggregator.open_rounds import PREFETCH_MAX_BYTES, OpenRounds
from services.aggregator.round_state import Round, RoundKey, RoundState
from services.aggregator.secure_rounds import SecureRounds
from services.aggregator.store import AggregatorStore, opened_row
from services.aggregator.wire_decode import take_in

log = logging.getLogger("apiary.aggregator")

# How long a report for a round not stored yet waits for its round.start before it is recorded as an orphan.
ROUND_START_WAIT = 10.0
ROUND_START_POLL = Backoff(base=0.02, cap=0.5)  # looks again after 0-0.02 s, doubling to 0-0.5 s


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
        self._secure = SecureRounds(self.bus, self.store)
        self._rounds.wrap = self._secure.strategy
        self._rounds.restore = self._secure.restore
        self._closer.secure_summary = self._secure.summary
        self._buffers = AsyncBuffers(self.store, self.storage, self.outbox)  # mode async (FedBuff) versions

    async def start(self) -> None:
        await self.store.migrate(self.name)
        await self.db.migrate(shard_states.COMPONENT, shard_states.MIGRATIONS)
        await self._buffers.migrate()
        await self.outbox.flush()
        handlers: dict[str, EventHandler] = {
            "round.start": self.on_round_start,
            "round.assigned": self.on_round_assigned,
            "worker.done": self.on_worker_done,
            "worker.failed": self.on_worker_failed,
            "worker.done.async": self.on_worker_done,  # a task of a job in mode async (the scheduler hears it too)
            "worker.failed.async": self.on_worker_failed,
            "round.timeout": self.on_round_timeout,
            "job.failed": self.on_job_ended,
            "job.completed": self.on_job_ended,
            "worker.secagg.keys": self.on_secagg_keys,
            "worker.secagg.shares": self.on_secagg_shares,
            "worker.secagg.check": self.on_secagg_check,
            "worker.secagg.reveal": self.on_secagg_reveal,
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
        if event.asynchronous is not None:
            async with self._locks(event.job_id):
                await self._buffers.on_round_start(event)
            return
        async with self._locks(event.job_id):
            row = opened_row(event)
            inserted = await self.store.open_round(row)
            if inserted:
                self._secure.start(Round.of(row))  # its key agreement begins with the round
            spec = self._rounds.known_spec(event.weights)
            if inserted and spec is not None:
                # A new round whose weights this aggregator wrote: nothing to read back before its results.
                await self._rounds.begin(Round.of(row), spec)

    async def on_round_assigned(self, event: contracts.RoundAssigned, delivery: Delivery) -> None:
        """Mode async: a training task was handed out; its report is judged by what this stores."""
        await self._buffers.on_assigned(event)

    async def _async_report(self, event: Report, delivery: Delivery) -> bool:
        """Mode async: the report of a training task goes to its job's open version (True), not to a round."""
        if self._rounds.held((event.job_id, event.round, event.attempt)) is not None:
            return False
        if not await self._buffers.owns(event.job_id):
            return False
        await self._buffers.task_known(event)
        async with self._locks(event.job_id):
            await self._buffers.on_report(event, delivery.user_id)
        return True

    async def on_worker_failed(self, event: contracts.WorkerFailed, delivery: Delivery) -> None:
        """The user's code failed on a shard: that shard settles without weights."""
        if await self._async_report(event, delivery):
            return
        await self._round_started(event)
        async with self._locks(event.job_id):
            state = await self._judge(event, delivery)
            if state is None:
                return
            settled = await self._settle(event, ContributionStatus.FAILED, event.error, state)
            await self._secure.advance(state)  # a secure round stops waiting for this shard's part
            await self._maybe_close(state, settled)

    async def on_worker_done(self, event: contracts.WorkerDone, delivery: Delivery) -> None:
        """A contribution, once: decode it, judge its report, take it in (or refuse it) and record that, and close
        the round if every shard has settled."""
        if await self._async_report(event, delivery):
            return
        fetched, _ = await asyncio.gather(self._prefetch(event), self._round_started(event))
        async with self._locks(event.job_id):
            state = await self._judge(event, delivery)
            if state is None:
                return
            try:
                kept = await shard_states.check(self.storage, self.db, event, state.round.weights.size)
                contribution = await self._decode(event, fetched, state)
                await self._secure.admit(state.round, event.shard)  # a secure round: its stages as stored
                # Its state's reference first (only an accepted shard's counts): a failure here leaves nothing held.
                await shard_states.remember(self.storage, self.db, event, kept)
                if state.round.strategy == SCAFFOLD:
                    contribution = await shard_states.with_control_deltas(self.storage, self.db, state.key,
                                                                          event.shard, contribution, kept)
                await take_in(state, event.shard, contribution)
            except (ObjectNotFound, InvalidContribution, WeightsError, ValueError) as e:
                settled = await self._reject(event, state, e)
                await self._maybe_close(state, settled)
                return
            # Recorded with the round's other reports taken in meanwhile (group commit), waited for outside the
            # lock; should the commit fail, the recorder drops the round's state, whose sum holds it.
            recorded = self._rounds.recorder.add(state.key, event)
        settled = await recorded
        metrics.contribution(ContributionStatus.ACCEPTED)
        if settled is not None and settled >= len(state.round.shards):
            await self._close_settled(state.key)

    async def on_round_timeout(self, event: contracts.RoundTimeout, delivery: Delivery) -> None:
        """The round's time is up: aggregate what arrived if enough did, else fail the round."""
        if await self._buffers.owns(event.job_id):
            async with self._locks(event.job_id):
                await self._buffers.on_timeout(event)
            return
        async with self._locks(event.job_id):
            state = await self._rounds.current((event.job_id, event.round, event.attempt))
            if not isinstance(state, Verdict):
                await self._close(state, timed_out=True)

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
            self._secure.drop_job(event.job_id)
            self._buffers.drop_job(event.job_id)
        if closed:
            log.info("job %s %s: its open round closed", event.job_id, ended)

    async def _round_started(self, event: Report) -> None:
        """Wait, outside the job's lock, until the report's round is stored (at most ROUND_START_WAIT s): with
        aggregator replicas a report can overtake its round's round.start, which another replica is still handling
        (it waits for that job's lock there, say, behind the close of the round before), and the database is all
        the replicas share. A round still missing then never started: `_judge` records the report as an orphan."""
        key = (event.job_id, event.round, event.attempt)
        if self._rounds.held(key) is not None or self._rounds.closed(key):
            return

        async def stored() -> bool:
            return await self.store.aggregation(*key) is not None

        await poll(stored, ROUND_START_POLL, ROUND_START_WAIT)

    async def _prefetch(self, event: contracts.WorkerDone) -> bytes | Exception | None:
        """Small contributions are fetched before queueing for the job's lock, so many download at
        once; large ones (None here) are fetched one at a time inside it (memory: one accumulator plus one)."""
        if event.result.key != keys.contribution(event.job_id, event.round, event.attempt, event.shard):
            return None  # another object than the shard's upload: _judge records the report as forged
        if event.result.size > PREFETCH_MAX_BYTES:
            return None
        try:
            return await self.storage.verified_bytes(event.result)
        except (ObjectNotFound, ValueError) as e:
            return e  # the refusal of a report that _judge may yet find forged, late or a duplicate

    async def _decode(self, event: contracts.WorkerDone, fetched: bytes | Exception | None,
                      state: RoundState) -> Contribution:
        """The report's contribution, from its prefetched bytes or fetched now (decoded, where it was encoded for
        the wire, against the round's global weights); raises why it cannot be one."""
        if isinstance(fetched, Exception):
            raise fetched
        if fetched is None:  # a large one: streamed from storage as it is folded
            contribution = await self._rounds.decoder.stored(event.result, state.round.weights, event.samples,
                                                             event.metrics)
        else:
            contribution = await self._rounds.decoder.contribution(fetched, state.round.weights, event.samples,
                                                                   event.metrics)
        return dataclasses.replace(contribution, shard=event.shard)

    async def _judge(self, event: Report, delivery: Delivery) -> RoundState | None:
        """The open round this report settles a shard of; None (recorded why) if it settles nothing: it
        is an orphan, late, forged (it never takes the genuine report's place), unassigned or a duplicate."""
        state = await self._rounds.current((event.job_id, event.round, event.attempt))
        if isinstance(state, Verdict):
            if state.status is ContributionStatus.LATE:
                log.info("job %s: late report for round %d/%d shard %d from %s ignored", event.job_id,
                         event.round, event.attempt, event.shard, event.worker_id)
            await self._record(event, state.status, state.reason)
            return None
        forged = judge_sender(event, state.round.digests_row, delivery.user_id)
        if forged is not None:
            log.warning("job %s: round %d shard %d: report from %s is forged: %s", event.job_id, event.round,
                        event.shard, event.worker_id, forged.reason)
            await self._record(event, forged.status, forged.reason)
            return None
        verdict = judge_shard(event.shard, state.round.shards, state.settled)
        if verdict is None:
            return state
        await self._record(event, verdict.status, verdict.reason)
        if verdict.status is ContributionStatus.DUPLICATE:
            # A redelivered last report whose first handling failed after it was recorded: the round
            # is still open, so close it now rather than at the timeout.
            await self._maybe_close(state)
        return None

    async def _reject(self, event: contracts.WorkerDone, state: RoundState, error: Exception) -> int | None:
        """Record a refused contribution; how many of the round's shards have settled now. A refusal that spoiled
        the round's sum leaves the state unsound: it is recovered from the accepted contributions when next used."""
        reason = f"object {event.result.key} is missing" if isinstance(error, ObjectNotFound) else str(error)
        log.warning("job %s: round %d shard %d from %s rejected: %s", event.job_id, event.round,
                    event.shard, event.worker_id, reason)
        return await self._settle(event, ContributionStatus.REJECTED, reason, state)

    async def _close_settled(self, key: RoundKey) -> None:
        """Close a round whose last shard a commit of accepted contributions settled (by the first of that group's
        handlers to get here: the others find it closed)."""
        async with self._locks(key[0]):
            state = await self._rounds.current(key)
            if not isinstance(state, Verdict):
                await self._close(state)

    async def _maybe_close(self, state: RoundState, settled: int | None = None) -> None:
        """Close the round if every shard has settled: here, or by any replica (`settled`, as counted when this
        one recorded its report, or read now): another aggregator replica may have settled the shards this
        one has not seen, and the one whose report settles the last shard counts them all."""
        if not all_settled(state.settled, state.round.shards):
            if settled is None:
                settled = await self.store.settled_shards(*state.key)
            if settled < len(state.round.shards):
                return
        await self._close(state)

    async def _close(self, state: RoundState, *, timed_out: bool | None = None) -> None:
        """Close the round (`timed_out` None: as a last shard settling after the deadline would); a secure round
        first, holding every accepted contribution (by any replica), goes through the stages that unmask it."""
        if state.round.secure is not None:
            state = await self._completed(state)
            if await self._secure.holds_back(state):
                return
        # A last shard settled after the deadline (a straggler stopped there) ends a round that timed out.
        if timed_out is None:
            timed_out = past_deadline(state.round.deadline, time.time())
        await self._closer.close(state, timed_out=timed_out)
        self._secure.drop(state.key)

    async def _completed(self, state: RoundState) -> RoundState:
        """A secure round's state holding the masked vectors of every accepted contribution, this replica's and
        any other's (the survivor set is fixed from them)."""
        await self._rounds.recorder.drain(state.key)
        rows = await self.store.contributions(*state.key)
        await self._secure.sync(state.round)
        return await self._rounds.complete(state, [r for r in rows if r["status"] == ContributionStatus.ACCEPTED])

    async def on_secagg_keys(self, event: contracts.SecAggKeys, delivery: Delivery) -> None:
        """Secure aggregation's stage 1: a shard's signed keys (services.aggregator.secure_rounds)."""
        async with self._secure_round(event) as state:
            if state is not None:
                await self._secure.on_keys(state, event, delivery.user_id)

    async def on_secagg_shares(self, event: contracts.SecAggShares, delivery: Delivery) -> None:
        """Secure aggregation's stage 2: a shard's encrypted shares."""
        async with self._secure_round(event) as state:
            if state is not None:
                await self._secure.on_shares(state, event, delivery.user_id)

    async def on_secagg_check(self, event: contracts.SecAggCheck, delivery: Delivery) -> None:
        """Secure aggregation's stage 4: a survivor's signature over the survivor set."""
        async with self._secure_round(event) as state:
            if state is not None:
                await self._secure.on_check(state, event, delivery.user_id)

    async def on_secagg_reveal(self, event: contracts.SecAggReveal, delivery: Delivery) -> None:
        """Secure aggregation's stage 5: a survivor's shares; the round closes once they rebuild every secret."""
        async with self._secure_round(event) as state:
            if state is not None and await self._secure.on_reveal(state, event, delivery.user_id):
                current = await self._rounds.current(state.key)
                if not isinstance(current, Verdict):
                    await self._close(current)

    @contextlib.asynccontextmanager
    async def _secure_round(self, event: contracts.SecAggKeys | contracts.SecAggShares | contracts.SecAggCheck
                            | contracts.SecAggReveal) -> AsyncIterator[RoundState | None]:
        """Under the job's lock, the open round a protocol message is for, or None (logged) if it is not open
        (waiting, outside the lock, for a round.start another replica may still be handling)."""
        key = (event.job_id, event.round, event.attempt)
        if self._rounds.held(key) is None and not self._rounds.closed(key):
            async def stored() -> bool:
                return await self.store.aggregation(*key) is not None

            await poll(stored, ROUND_START_POLL, ROUND_START_WAIT)
        async with self._locks(event.job_id):
            state = await self._rounds.current(key)
            if isinstance(state, Verdict):
                log.info("job %s: %s for round %d/%d ignored: %s", event.job_id, event.routing_key, event.round,
                         event.attempt, state.reason)
                yield None
            else:
                yield state

    async def _record(self, event: Report, status: ContributionStatus, reason: str) -> None:
        """Store a report that settles nothing."""
        await self.store.record(event, status, reason)
        metrics.contribution(status)

    async def _settle(self, event: Report, status: ContributionStatus, reason: str | None,
                      state: RoundState) -> int | None:
        """Store a report that settles its shard without weights; how many of the round's shards have settled."""
        metrics.contribution(status)
        return await state.settle(event.shard, status, self.store.record(event, status, reason))
