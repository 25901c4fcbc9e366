"""Reports arriving together are recorded a group per transaction (SQLite and PostgreSQL): a round of twelve costs a
few commits, not twelve, with the bits of one report at a time. A commit that fails fails its group and the groups
queued behind it: those reports are delivered again, and the round still closes with each contribution counted
once."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from apiary import keys, proof
from apiary.bus import Delivery
from apiary.bus.identity import service_user
from apiary.bus.memory import MemoryBus
from apiary.contracts import ObjectRef, RoundAggregated, RoundStart, WorkerDone
from apiary.db import Database
from apiary.db.base import DatabaseUnavailable
from apiary.storage.local import LocalStorage
from apiary.strategies.weighted_sum import WeightedSum
from apiary.weights import dumps, loads
from services.aggregator import Aggregator
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
    commits of accepted contributions counted (each takes `commit_delay` s) and the first `failing` of them
    failing as if the database went away."""

    def __init__(self, database: Database, tmp_path: Path, *, commit_delay: float, failing: int = 0) -> None:
        self.bus = MemoryBus(service_user("aggregator"))
        self.storage = LocalStorage(tmp_path / "store")
        self.aggregator = Aggregator(self.bus, database, self.storage)
        self.database = database
        self.secrets = {shard: proof.new_secret() for shard in range(SHARDS)}
        self.announced: list[RoundAggregated] = []
        self.groups: list[int] = []  # the size of each group committed, in order
        store, record = self.aggregator.store, self.aggregator.store.record_settling
        left = [failing]

        async def counted(key: tuple[str, int, int], rows: Sequence[tuple[Any, ...]]) -> int | None:
            await asyncio.sleep(commit_delay)
            if left[0] > 0:
                left[0] -= 1
                raise DatabaseUnavailable("the database went away", dependency="the test's database")
            settled = await record(key, rows)
            self.groups.append(len(rows))
            return settled

        store.record_settling = counted  # type: ignore[method-assign]

    async def start(self) -> None:
        await self.bus.connect()
        await self.aggregator.start()
        self.announced = await tap_aggregated(self.bus)
        start = RoundStart(job_id=JOB, round=1, num_rounds=1, shards=list(self.secrets), min_workers=SHARDS,
                           weights=await self._stored(keys.global_weights(JOB, 0), {"w": torch.zeros(32)}),
                           deadline=time.time() + 300,
                           secret_digests={shard: proof.digest(s) for shard, s in self.secrets.items()})
        await self.aggregator.on_round_start(start, Delivery("round.start", b""))

    async def _stored(self, key: str, weights: dict[str, torch.Tensor]) -> ObjectRef:
        data = dumps(weights)
        await self.storage.put_bytes(key, data)
        return ObjectRef(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())

    async def report(self, shard: int) -> None:
        result = await self._stored(keys.contribution(JOB, 1, 1, shard), contribution(shard))
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
    round_ = Round(database, tmp_path, commit_delay=0.05)
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
    round_ = Round(database, tmp_path, commit_delay=0.05, failing=1)
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
    round_ = Round(database, tmp_path, commit_delay=0.05, failing=1)
    await round_.start()
    # One report's commit is under way (and will fail) when the others arrive one by one
    first = asyncio.create_task(round_.report(0))
    await asyncio.sleep(0.01)
    later = asyncio.gather(*(round_.report(shard) for shard in range(1, SHARDS)), return_exceptions=True)
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
    round_ = Round(database, tmp_path, commit_delay=0.1)
    await round_.start()
    # Prepare: shard 0 commits alone; shards 1-11 queue behind it as one group
    tasks = [asyncio.create_task(round_.report(shard)) for shard in range(SHARDS)]
    await asyncio.sleep(0.05)

    # Execute: the aggregator stops waiting on shard 5's delivery (its consumer was cancelled)
    tasks[5].cancel()
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)

    # Assert: only that handler saw the cancellation; its row was committed with its group all the same, so its
    # delivery, coming again, is a duplicate, and the round closed with every contribution once
    assert [i for i, o in enumerate(outcomes) if o is not None] == [5]
    assert isinstance(outcomes[5], asyncio.CancelledError)
    assert await round_.report_all([5]) == []
    result = await round_.stop()
    assert loads(result)["w"].numpy().tobytes() == expected()
    assert await round_.accepted_rows() == dict.fromkeys(range(SHARDS), 1)
    assert round_.groups == [1, SHARDS - 1]
