"""The aggregator's count of a round's settled shards (on SQLite and on PostgreSQL): kept with each settling
report in the same transaction, so closing a round reads one row instead of counting its contributions after
each report; exact when replicas record at once and unchanged by a refused duplicate. Its schema refuses a round
without the secret digests, and a later migration step applies on top of it."""

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


async def test_a_later_migration_step_applies_once_on_top_of_the_schema_and_its_rows(database: Database) -> None:
    # Prepare: the schema as released, with a round stored in it
    store = await _store(database, 2)
    await store.record(_done(0), ContributionStatus.ACCEPTED, None)
    later = "ALTER TABLE aggregations ADD COLUMN note TEXT; UPDATE aggregations SET note = 'kept'"

    # Execute
    applied = [await database.migrate("aggregator", [*MIGRATIONS, later]) for _ in range(2)]

    # Assert
    assert applied == [1, 0]
    assert await database.fetchval("SELECT note FROM aggregations WHERE job_id = 'j'") == "kept"
    assert await store.settled_shards("j", 1, 1) == 1


async def test_a_round_without_its_secret_digests_is_refused_by_the_schema(database: Database) -> None:
    # Prepare
    store = AggregatorStore(database)
    await store.migrate("aggregator")
    row = {**opened_row(_start(1)), "secret_digests": None}

    # Execute, Assert
    with pytest.raises(Exception):  # noqa: B017 - each engine names its NOT NULL violation its own way
        await store.open_round(row)
    assert await store.aggregation("j", 1, 1) is None
