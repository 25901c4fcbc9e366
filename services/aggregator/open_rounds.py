"""The open rounds an aggregator holds in memory: a cache of its tables and storage, recovered from them on demand."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from apiary.component import from_json
from apiary.contracts import ObjectRef
from apiary.jobspec import SCAFFOLD
from apiary.status import ContributionStatus, RoundStatus
from apiary.storage import Storage
from apiary.strategies.base import Strategy, create
from apiary.strategies.private import private
from apiary.weights import WeightSpec, spec_of
from apiary.weights import loads as load_weights
from services.aggregator import shard_states
from services.aggregator.decisions import Verdict, judge_round
from services.aggregator.recording import GroupRecorder
from services.aggregator.round_state import Round, RoundKey, RoundState
from services.aggregator.store import AggregatorStore
from services.aggregator.wire_decode import UpdateDecoder, streams, take_in

SPEC_CACHE = 256  # global weights whose names, dtypes and shapes are remembered
# Contributions downloading at once while a round is folded from storage (after a restart, or by the replica
# closing a round another one took part of): latency overlaps, memory stays bounded.
FETCH_AHEAD = 16
FETCH_AHEAD_BYTES = 64 * 2**20
PREFETCH_MAX_BYTES = 8 * 1024 * 1024  # a larger contribution is fetched alone, here and as it arrives


class OpenRounds:
    """The rounds whose running state this aggregator holds, and the specs of global weights it knows."""

    def __init__(self, store: AggregatorStore, storage: Storage) -> None:
        self._store, self._storage = store, storage
        # Accepted contributions' rows, committed a group at a time; a failed commit drops the round's state.
        self.recorder = GroupRecorder(store, self.drop)
        self._rounds: dict[RoundKey, RoundState] = {}
        self._specs: dict[tuple[str, str], WeightSpec] = {}
        self._states: dict[tuple[str, int], str | None] = {}  # (job, round) -> its strategy state's key
        # Rounds this aggregator closed (a closed row never opens again): the reports still on their way for them
        # (a commit group's other handlers, stragglers) are judged late without reading the row back.
        self._closed: dict[RoundKey, RoundStatus] = {}
        # What wraps each round's strategy (secure aggregation's masked sum, services.aggregator.secure_rounds).
        self.wrap: Callable[[Round, Strategy], Strategy] = lambda round_, strategy: strategy
        # What a round's state needs restored before its strategy is made (secure aggregation's key agreement).
        self.restore: Callable[[Round], Awaitable[None]] = _nothing
        # Uploads encoded for the wire (distributed.transfer) decoded into full-precision weights.
        self.decoder = UpdateDecoder(storage)

    def keys(self) -> list[RoundKey]:
        """(job, round, attempt) of each round held."""
        return list(self._rounds)

    def held(self, key: RoundKey) -> RoundState | None:
        """The round's state if held and sound."""
        state = self._rounds.get(key)
        return state if state is not None and state.sound else None

    async def current(self, key: RoundKey) -> RoundState | Verdict:
        """The open round's state (called under the job's lock): held, or recovered from its rows if it is not
        held or not sound (a change stopped part way, a spoiled sum); or why it is not open (it never started
        here, or it is closed)."""
        state = self.held(key)
        if state is not None:
            return state
        self.drop(key)
        closed = self._closed.get(key)
        if closed is not None:
            return Verdict(ContributionStatus.LATE, f"round already {closed}")
        row = await self._store.aggregation(*key)
        verdict = judge_round(row)
        if verdict is not None:
            return verdict
        assert row is not None  # judge_round calls a missing round an orphan
        return await self.recover(Round.of(row))

    def drop(self, key: RoundKey) -> None:
        """Forget a round's state (it is recovered from the tables and storage if needed again)."""
        self._rounds.pop(key, None)

    def closed(self, key: RoundKey) -> bool:
        """Whether this aggregator closed the round."""
        return key in self._closed

    def remember_closed(self, key: RoundKey, status: RoundStatus) -> None:
        """The round's row was closed here, as `status`, and committed (the least recent goes beyond SPEC_CACHE)."""
        self._closed[key] = status
        while len(self._closed) > SPEC_CACHE:
            del self._closed[next(iter(self._closed))]

    def drop_job(self, job_id: str) -> None:
        """Forget every round of a job."""
        for key in [k for k in self._rounds if k[0] == job_id]:
            del self._rounds[key]

    def known_spec(self, ref: ObjectRef) -> WeightSpec | None:
        """The spec of global weights this aggregator wrote or read lately."""
        return self._specs.get((ref.key, ref.sha256))

    def remember_spec(self, ref: ObjectRef, spec: WeightSpec) -> None:
        """Keep a spec for the next rounds (the least recent goes beyond SPEC_CACHE)."""
        self._specs[(ref.key, ref.sha256)] = spec
        while len(self._specs) > SPEC_CACHE:
            del self._specs[next(iter(self._specs))]

    def remember_state(self, job_id: str, round_index: int, state_key: str | None) -> None:
        """Where the strategy's server state after a round this aggregator aggregated is stored (None: it
        keeps none), for the job's next round (the least recent goes beyond SPEC_CACHE)."""
        self._states[(job_id, round_index)] = state_key
        while len(self._states) > SPEC_CACHE:
            del self._states[next(iter(self._states))]

    async def begin(self, round_: Round, spec: WeightSpec) -> RoundState:
        """Hold a round that has just started: nothing settled, its strategy begun."""
        state = await self._fresh(round_, spec)
        self._rounds[state.key] = state
        return state

    async def recover(self, round_: Round) -> RoundState:
        """An open round's state from its rows: the shards settled so far, and the strategy's state
        re-folded from the stored accepted contributions (after a restart, or when the held state was dropped or
        not sound), once the rows queued for it are committed (or failed: their contributions are delivered
        again)."""
        with contextlib.suppress(Exception):
            await self.recorder.drain(round_.key)
        spec = self.known_spec(round_.weights)
        if spec is None:
            spec = spec_of(await self._storage.get_bytes(round_.weights.key))
            self.remember_spec(round_.weights, spec)
        state = await self._fresh(round_, spec)
        rows = await self._store.contributions(*state.key)
        for row in rows:
            status = ContributionStatus(row["status"])
            if status.settles and status is not ContributionStatus.ACCEPTED:
                state.settled[row["shard"]] = status
        await self._take_in(state, [row for row in rows if row["status"] == ContributionStatus.ACCEPTED])
        self._rounds[state.key] = state
        return state

    async def complete(self, state: RoundState, accepted: list[dict[str, Any]]) -> RoundState:
        """The round's state holding every accepted contribution (their rows, in stored order): those another
        aggregator replica took are folded in after this one's own (only the replica that claims the round's
        row writes its result: RoundCloser), or, if this state cannot take them, the round is recovered."""
        held = {shard for shard, status in state.settled.items() if status == ContributionStatus.ACCEPTED}
        shards = {row["shard"] for row in accepted}
        if held == shards:
            return state
        if held <= shards and state.sound:
            await self._take_in(state, [row for row in accepted if row["shard"] not in held])
            return state
        self.drop(state.key)
        return await self.recover(state.round)

    async def _take_in(self, state: RoundState, rows: list[dict[str, Any]]) -> None:
        """Fold accepted contributions (their rows) into the round's strategy in the rows' order, the next
        ones downloading meanwhile."""
        async with contextlib.aclosing(self._fetched(rows)) as fetched:
            async for row, data in fetched:
                metrics = from_json(row["metrics"], {})
                if data is None:  # a large one: streamed from storage as it is folded
                    ref = ObjectRef(key=row["result_key"], size=row["size"], sha256=row["sha256"])
                    contribution = await self.decoder.stored(ref, state.round.weights, row["samples"], metrics)
                else:
                    contribution = await self.decoder.contribution(data, state.round.weights, row["samples"], metrics)
                contribution = dataclasses.replace(contribution, shard=row["shard"])
                if state.round.strategy == SCAFFOLD:  # its control deltas, derived from the shard's states again
                    contribution = await shard_states.with_control_deltas(self._storage, self._store.db, state.key,
                                                                          row["shard"], contribution)
                await take_in(state, row["shard"], contribution)

    async def _fetched(self, rows: list[dict[str, Any]]) -> AsyncGenerator[tuple[dict[str, Any], bytes | None]]:
        """Each row with its object's verified bytes, in order, up to FETCH_AHEAD objects (FETCH_AHEAD_BYTES in
        all; a larger one alone) downloading at once."""
        window: collections.deque[tuple[dict[str, Any], asyncio.Future[bytes | None]]] = collections.deque()
        pending, queued = collections.deque(rows), 0
        try:
            while window or pending:
                # A contribution over PREFETCH_MAX_BYTES downloads alone (memory: the sum plus one large one).
                while pending and (not window or (len(window) < FETCH_AHEAD
                                                  and queued + pending[0]["size"] <= FETCH_AHEAD_BYTES
                                                  and window[0][0]["size"] <= PREFETCH_MAX_BYTES
                                                  and pending[0]["size"] <= PREFETCH_MAX_BYTES)):
                    row = pending.popleft()
                    ref = ObjectRef(key=row["result_key"], size=row["size"], sha256=row["sha256"])
                    window.append((row, asyncio.ensure_future(self._verified(ref))))
                    queued += row["size"]
                row, task = window.popleft()
                queued -= row["size"]
                yield row, await task
        finally:
            for _, task in window:
                task.cancel()
            await asyncio.gather(*(task for _, task in window), return_exceptions=True)

    async def _verified(self, ref: ObjectRef) -> bytes | None:
        """A contribution's verified bytes; None for one large enough to be streamed as it is folded."""
        return None if streams(ref.size) else await self._storage.verified_bytes(ref)

    async def _fresh(self, round_: Round, spec: WeightSpec) -> RoundState:
        """A round's state with nothing taken in: the strategy its row names, begun on the round's spec,
        with the server state the job's previous round left (so a restarted aggregator resumes exactly)."""
        await self.restore(round_)
        inner = private(create(round_.strategy, round_.strategy_params), round_.privacy)
        inner.population(len(round_.shards))
        strategy = self.wrap(round_, inner)
        global_weights = None
        if strategy.needs_start_weights():
            global_weights = load_weights(await self._storage.get_bytes(round_.weights.key))
        strategy.begin(spec, round_.update_format, global_weights)
        job_id, round_index, _ = round_.key
        state_key = await self._previous_state_key(job_id, round_index)
        if state_key is not None:
            strategy.load_state(load_weights(await self._storage.get_bytes(state_key)))
        return RoundState(round=round_, strategy=strategy)

    async def _previous_state_key(self, job_id: str, round_index: int) -> str | None:
        # A round starts once the one before it aggregated: if this aggregator aggregated it, the key is known.
        known = (job_id, round_index - 1)
        if known in self._states:
            return self._states[known]
        return await self._store.previous_state_key(job_id, round_index)


async def _nothing(round_: Round) -> None:
    return None
