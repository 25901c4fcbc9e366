"""Each service's schema (on SQLite and on PostgreSQL) is one baseline step that a database applies once; the
tables it makes hold the rows the services write, and refuse rounds without their secret digests."""

from __future__ import annotations

import pytest

from apiary.db import Database
from services.aggregator import buffers as aggregator_async
from services.aggregator import shard_states as aggregator_shard_states
from services.aggregator import store as aggregator_store
from services.scheduler import async_rounds as scheduler_async
from services.scheduler import shard_evaluations as scheduler_shard_evaluations
from services.scheduler import shard_states as scheduler_shard_states
from services.scheduler import store as scheduler_store
from services.scheduler import task_proofs
from services.sharder import store as sharder_store
from services.tracker import async_views as tracker_async
from services.tracker import registry_store, token_store
from services.tracker import store as tracker_store

SCHEMAS = {
    "aggregator": aggregator_store.MIGRATIONS,
    "scheduler": scheduler_store.MIGRATIONS,
    task_proofs.COMPONENT: task_proofs.MIGRATIONS,
    "sharder": sharder_store.MIGRATIONS,
    "tracker": tracker_store.MIGRATIONS,
    registry_store.COMPONENT: registry_store.MIGRATIONS,
    token_store.COMPONENT: token_store.MIGRATIONS,
    aggregator_shard_states.COMPONENT: aggregator_shard_states.MIGRATIONS,
    scheduler_shard_states.COMPONENT: scheduler_shard_states.MIGRATIONS,
    scheduler_shard_evaluations.COMPONENT: scheduler_shard_evaluations.MIGRATIONS,
    aggregator_async.COMPONENT: aggregator_async.MIGRATIONS,
    scheduler_async.COMPONENT: scheduler_async.MIGRATIONS,
    scheduler_async.WAITS_COMPONENT: scheduler_async.WAITS_MIGRATIONS,
    tracker_async.COMPONENT: tracker_async.MIGRATIONS,
}


async def test_each_schema_is_one_baseline_step_applied_once(database: Database) -> None:
    # Execute
    first = {component: await database.migrate(component, steps) for component, steps in SCHEMAS.items()}
    again = {component: await database.migrate(component, steps) for component, steps in SCHEMAS.items()}

    # Assert
    assert first == dict.fromkeys(SCHEMAS, 1)
    assert again == dict.fromkeys(SCHEMAS, 0)


async def test_a_tracker_shard_view_keeps_the_digests_round_start_announced(database: Database) -> None:
    # Prepare
    await database.migrate("tracker", tracker_store.MIGRATIONS)

    # Execute
    async with database.transaction() as tx:
        await tracker_store.round_started(tx, "j", 1, 1, {0: ("s0", "p0"), 1: ("", "")}, 1.0)
        first = await tracker_store.shard_digest_row(tx, "j", 1, 1, 0)
        unannounced = await tracker_store.shard_digest_row(tx, "j", 1, None, 1)

    # Assert
    assert first == {"secret_digest": "s0", "progress_digest": "p0"}
    assert unannounced == {"secret_digest": "", "progress_digest": ""}
    with pytest.raises(Exception):  # noqa: B017 - each engine names its NOT NULL violation its own way
        await database.execute("INSERT INTO shard_views (job_id, round, attempt, shard, state, updated_at)"
                               " VALUES ('j', 1, 1, 2, 'assigned', 1.0)")


async def test_a_scheduler_round_keeps_its_span_ids(database: Database) -> None:
    # Prepare
    await database.migrate("scheduler", scheduler_store.MIGRATIONS)

    # Execute
    async with database.transaction() as tx:
        await scheduler_store.insert_round(tx, "j", 1, 1, [0], 1.0, 61.0, (0xAB, 0xCD))
        row = await scheduler_store.running_round(tx, "j", 1, 1)

    # Assert
    assert row is not None and (row["trace_id"], row["span_id"]) == (f"{0xAB:032x}", f"{0xCD:016x}")
    with pytest.raises(Exception):  # noqa: B017 - each engine names its NOT NULL violation its own way
        await database.execute("INSERT INTO rounds (job_id, round, attempt, status, shards, started_at, deadline)"
                               " VALUES ('j', 2, 1, 'running', '[0]', 1.0, 61.0)")
