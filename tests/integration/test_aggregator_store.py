"""The aggregator's count of a round's settled shards (on SQLite and on PostgreSQL): kept with each settling
report in the same transaction, so closing a round reads one row instead of counting its contributions after
each report; exact when replicas record at once, unchanged by a refused duplicate, and filled in for rounds
stored before the column existed."""

from __future__ import annotations

import asyncio

import pytest

from apiary.contracts import ObjectRef, RoundStart, WorkerDone, WorkerFailed
from apiary.db import Database
from apiary.status import ContributionStatus
from services.aggregator.store import MIGRATIONS, AggregatorStore, opened_row


def _start(shards: int) -> RoundStart:
    return RoundStart(job_id="j", round=1, attempt=1, num_rounds=2, shards=list(range(shards)), min_workers=1,
                      weights=ObjectRef(key="jobs/j/weights/round-0000.safetensors", size=1, sha256="a" * 64),
                      deadline=1e12)


def _done(shard: int) -> WorkerDone:
    return WorkerDone(job_id="j", round=1, attempt=1, shard=shard, worker_id=f"w{shard}", samples=3,
                      result=ObjectRef(key=f"jobs/j/contributions/{shard}", size=1, sha256="b" * 64))


async def _store(database: Database, shards: int) -> AggregatorStore:
    store = AggregatorStore(database)
    await store.migrate("aggregator")
    assert await store.open_round(opened_row(_start(shards)))
    return store


async def test_each_settling_report_returns_the_rounds_count(database: Database) -> None:
    # Prepare
    store = await _store(database, 4)

    # Execute
    counts = [await store.record(_done(0), ContributionStatus.ACCEPTED, None),
              await store.record(_done(1), ContributionStatus.LATE, "late"),
              await store.record(WorkerFailed(job_id="j", round=1, attempt=1, shard=1, worker_id="w1", error="boom"),
                                 ContributionStatus.FAILED, "boom"),
              await store.record(_done(2), ContributionStatus.REJECTED, "bad weights")]

    # Assert
    assert counts == [1, None, 2, 3]
    assert await store.settled_shards("j", 1, 1) == 3


async def test_a_duplicate_settling_report_is_refused_without_counting(database: Database) -> None:
    # Prepare
    store = await _store(database, 2)
    await store.record(_done(0), ContributionStatus.ACCEPTED, None)

    # Execute
    with pytest.raises(Exception):  # noqa: B017 - each engine names its unique violation its own way
        await store.record(_done(0), ContributionStatus.ACCEPTED, None)

    # Assert
    assert await store.settled_shards("j", 1, 1) == 1
    assert len(await store.contributions("j", 1, 1)) == 1


async def test_replicas_recording_at_once_count_every_shard_once(database: Database) -> None:
    # Prepare: two stores on the one database, as two aggregator replicas hold
    store = await _store(database, 40)
    other = AggregatorStore(database)

    # Execute
    counts = await asyncio.gather(*[(store if shard % 2 else other).record(
        _done(shard), ContributionStatus.ACCEPTED, None) for shard in range(40)])

    # Assert: the increments are serialised, so exactly one report saw the round complete
    assert sorted(c for c in counts if c is not None) == list(range(1, 41))
    assert await store.settled_shards("j", 1, 1) == 40


async def test_rounds_stored_before_the_count_get_it_from_their_contributions(database: Database) -> None:
    # Prepare: the tables as the migrations before the count left them, with a round half settled
    await database.migrate("aggregator", MIGRATIONS[:-1])
    old = AggregatorStore(database)
    row = opened_row(_start(3))
    del row["settled"]
    assert await old.open_round(row)
    for shard, status in ((0, "accepted"), (1, "late"), (2, "failed")):
        await database.execute(
            "INSERT INTO contributions (job_id, round, attempt, shard, worker_id, status, samples, result_key,"
            " size, sha256, metrics, received_at) VALUES ('j', 1, 1, $1, 'w', $2, 1, 'k', 1, 's', '{}', 0)",
            shard, status)

    # Execute
    await AggregatorStore(database).migrate("aggregator")

    # Assert
    assert await old.settled_shards("j", 1, 1) == 2
