"""Reports arriving together are recorded a group per transaction (SQLite and PostgreSQL): a round of twelve costs a
few commits, not twelve, with the bits of one report at a time. A commit that fails fails its group and the groups
queued behind it: those reports are delivered again, and the round still closes with each contribution counted
once.

How reports group depends on when each handler reaches the recorder, so the tests set that timing themselves: a
commit may be held until a given number of reports are queued (`hold_commit`), and each commit's start is an event
the test can wait on; nothing waits on a sleep."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from apiary import keys, proof
from apiary.bus import Delivery
from apiary.bus.identity import service_user
from apiary.bus.memory import MemoryBus
from apiary.contracts import RoundAggregated, WorkerDone
from apiary.db import Database
from apiary.db.base import DatabaseUnavailable
from apiary.storage.local import LocalStorage
from apiary.strategies.weighted_sum import WeightedSum
from apiary.weights import loads
from services.aggregator import Aggregator
from tests.fixtures.aggregator_round import first_round, store_weights
from tests.fixtures.services import tap_aggregated

JOB = "grouped"
SHARDS = 12
WAIT = 30.0  # seconds a batch of reports may take before the test fails


def contribution(shard: int) -> dict[str, torch.Tensor]:
    """A worker's weights, values far apart in magnitude so that a sum in another order shows."""
    w = torch.randn(32, generator=torch.Generator().manual_seed(shard)) * 10 ** (shard % 5)
    return {"w": w}


def samples(shard: int) -> int:
    return 3 + 17 * shard


def expected() -> bytes:
    total = WeightedSum()
    for shard in range(SHARDS):
        total.fold(contribution(shard), samples(shard))
    return total.finish()["w"].numpy().tobytes()


class Round:
    """One aggregator on a memory bus, a database and a folder, with round 1 of a twelve-shard job started, its
    commits of accepted contributions counted and the first `failing` of them failing as if the database went away.

    `hold_commit(n, until_queued=q)` keeps the n-th commit (from 0) from starting its transaction until q reports in
    all have been queued for recording; `release(n)` lets a held commit go; `commit_started(n)` waits until the n-th
    commit has been called."""

    def __init__(self, database: Database, tmp_path: Path, *, failing: int = 0) -> None:
        self.bus = MemoryBus(service_user("aggregator"))
        self.storage = LocalStorage(tmp_path / "store")
        self.aggregator = Aggregator(self.bus, database, self.storage)
        self.database = database
        self.secrets = {shard: proof.new_secret() for shard in range(SHARDS)}
        self.announced: list[RoundAggregated] = []
        self.groups: list[int] = []  # the size of each group committed, in order
        self.shards: dict[int, list[int]] = {}  # the shards of the n-th commit's group, once it is called
        self.queued = 0  # reports handed to the recorder so far
        self._queued_changed = asyncio.Event()
        self._holds: dict[int, tuple[int | None, asyncio.Event]] = {}
        self._started: collections.defaultdict[int, asyncio.Event] = collections.defaultdict(asyncio.Event)
        store, record = self.aggregator.store, self.aggregator.store.record_settling
        recorder = self.aggregator._rounds.recorder
        add = recorder.add
        calls = [0]
        left = [failing]

        def counting_add(key: tuple[str, int, int], report: WorkerDone) -> asyncio.Future[int | None]:
            committed = add(key, report)
            self.queued += 1
            self._queued_changed.set()
            return committed

        async def counted(key: tuple[str, int, int], rows: Sequence[tuple[Any, ...]]) -> int | None:
            n, calls[0] = calls[0], calls[0] + 1
            self.shards[n] = [row[3] for row in rows]  # contribution_row: (job, round, attempt, shard, ...)
            self._started[n].set()
            if n in self._holds:
                until_queued, released = self._holds[n]
                if until_queued is not None:
                    await self.wait_queued(until_queued)
                await asyncio.wait_for(released.wait(), WAIT)
            if left[0] > 0:
                left[0] -= 1
                raise DatabaseUnavailable("the database went away", dependency="the test's database")
            settled = await record(key, rows)
            self.groups.append(len(rows))
            return settled

        recorder.add = counting_add  # type: ignore[method-assign]
        store.record_settling = counted  # type: ignore[method-assign]

    def hold_commit(self, n: int, *, until_queued: int | None = None) -> None:
        """Hold the n-th commit: until `until_queued` reports are queued if given, else until `release(n)`."""
        released = asyncio.Event()
        if until_queued is not None:
            released.set()
        self._holds[n] = (until_queued, released)

    def release(self, n: int) -> None:
        """Let the n-th commit, held by `hold_commit(n)`, start its transaction."""
        self._holds[n][1].set()

    async def commit_started(self, n: int) -> None:
        """Wait until the n-th commit has been called (and is held, or under way)."""
        await asyncio.wait_for(self._started[n].wait(), WAIT)

    async def wait_queued(self, count: int) -> None:
        """Wait until `count` reports in all have been handed to the recorder."""
        async with asyncio.timeout(WAIT):
            while self.queued < count:
                self._queued_changed.clear()
                await self._queued_changed.wait()

    async def start(self) -> None:
        await self.bus.connect()
        await self.aggregator.start()
        self.announced = await tap_aggregated(self.bus)
        start = await first_round(self.storage, JOB, self.secrets, {"w": torch.zeros(32)}, min_workers=SHARDS)
        await self.aggregator.on_round_start(start, Delivery("round.start", b""))


    async def report(self, shard: int) -> None:
        result = await store_weights(self.storage, keys.contribution(JOB, 1, 1, shard), contribution(shard))
        done = WorkerDone(job_id=JOB, round=1, worker_id=f"w{shard}", shard=shard, result=result,
                          samples=samples(shard), secret=self.secrets[shard])
        await self.aggregator.on_worker_done(done, Delivery("worker.done", b""))

    async def report_all(self, shards: Sequence[int]) -> list[int]:
        """Every shard's report handled at once (a prefetching consumer); the shards whose handler failed."""
        outcomes = await asyncio.wait_for(  # a report left waiting for a commit that never comes fails here
            asyncio.gather(*(self.report(shard) for shard in shards), return_exceptions=True), WAIT)
        for outcome in outcomes:
            assert outcome is None or isinstance(outcome, DatabaseUnavailable), outcome
        return [shard for shard, outcome in zip(shards, outcomes, strict=True) if outcome is not None]

    async def stop(self) -> bytes:
        """Stop; the bytes of the round's stored result."""
        await self.aggregator.stop()
        await self.bus.close()
        return await self.storage.get_bytes(keys.global_weights(JOB, 1))

    async def accepted_rows(self) -> dict[int, int]:
        rows = await self.database.fetch(
            "SELECT shard, COUNT(*) AS n FROM contributions WHERE job_id = $1 AND status = 'accepted' GROUP BY shard",
            JOB)
        return {row["shard"]: row["n"] for row in rows}


async def test_reports_arriving_together_share_a_commit(database: Database, tmp_path: Path) -> None:
    round_ = Round(database, tmp_path)
    round_.hold_commit(0, until_queued=SHARDS)  # the first report commits once every other one is queued
    await round_.start()

    assert await round_.report_all(range(SHARDS)) == []
    result = await round_.stop()

    # The first report's commit carried it alone; the eleven taken in meanwhile shared the next
    assert round_.groups == [1, SHARDS - 1]
    assert loads(result)["w"].numpy().tobytes() == expected()
    assert await round_.accepted_rows() == dict.fromkeys(range(SHARDS), 1)
    [event] = round_.announced
    assert event.contributors == list(range(SHARDS))
    settled = await database.fetchval("SELECT settled FROM aggregations WHERE job_id = $1", JOB)
    assert settled == SHARDS


async def test_a_failed_commit_fails_its_group_and_those_queued_behind_it(database: Database, tmp_path: Path) -> None:
    round_ = Round(database, tmp_path, failing=1)
    round_.hold_commit(0, until_queued=SHARDS // 2)
    await round_.start()

    # Prepare: the first half arrives; the first commit fails while the rest of that half is queued behind it
    first = await round_.report_all(range(SHARDS // 2))
    assert first == list(range(SHARDS // 2))
    assert await round_.accepted_rows() == {}

    # Execute: the broker delivers the failed reports again, with the second half
    assert await round_.report_all([*first, *range(SHARDS // 2, SHARDS)]) == []
    result = await round_.stop()

    # Assert: each contribution counted once, the same bits as if nothing had failed
    assert loads(result)["w"].numpy().tobytes() == expected()
    assert await round_.accepted_rows() == dict.fromkeys(range(SHARDS), 1)
    assert sum(round_.groups) == SHARDS
    [event] = round_.announced
    assert event.contributors == list(range(SHARDS))


async def test_a_report_folded_while_a_commit_fails_is_not_lost(database: Database, tmp_path: Path) -> None:
    round_ = Round(database, tmp_path, failing=1)
    round_.hold_commit(0)
    await round_.start()
    # One report's commit is under way (and will fail) when the others arrive one by one
    first = asyncio.create_task(round_.report(0))
    await round_.commit_started(0)
    later = asyncio.gather(*(round_.report(shard) for shard in range(1, SHARDS)), return_exceptions=True)
    await round_.wait_queued(2)  # another report is folded and queued before the commit fails
    round_.release(0)
    outcomes = [await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), WAIT),
                await asyncio.wait_for(later, WAIT)]
    failed = [0] if outcomes[0][0] is not None else []
    failed += [shard for shard, o in zip(range(1, SHARDS), outcomes[1], strict=True) if o is not None]

    assert await round_.report_all(failed) == []
    result = await round_.stop()

    assert 0 in failed
    assert loads(result)["w"].numpy().tobytes() == expected()
    assert await round_.accepted_rows() == dict.fromkeys(range(SHARDS), 1)


async def test_a_handler_cancelled_while_its_group_commits_cancels_no_other(database: Database,
                                                                            tmp_path: Path) -> None:
    round_ = Round(database, tmp_path)
    # The first report to reach the recorder (whichever shard: the reports race) commits alone, held until the
    # others are queued behind it as one group, which is held in turn.
    round_.hold_commit(0, until_queued=SHARDS)
    round_.hold_commit(1)
    await round_.start()
    tasks = [asyncio.create_task(round_.report(shard)) for shard in range(SHARDS)]

    # Execute: while that group commits, the aggregator stops waiting on the delivery of one of its shards (its
    # consumer was cancelled)
    await round_.commit_started(1)
    victim = round_.shards[1][len(round_.shards[1]) // 2]
    tasks[victim].cancel()
    round_.release(1)
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)

    # Assert: only that handler saw the cancellation; its row was committed with its group all the same, so its
    # delivery, coming again, is a duplicate, and the round closed with every contribution once
    assert [i for i, o in enumerate(outcomes) if o is not None] == [victim]
    assert isinstance(outcomes[victim], asyncio.CancelledError)
    assert await round_.report_all([victim]) == []
    result = await round_.stop()
    assert loads(result)["w"].numpy().tobytes() == expected()
    assert await round_.accepted_rows() == dict.fromkeys(range(SHARDS), 1)
    assert round_.groups == [len(round_.shards[0]), SHARDS - len(round_.shards[0])]
