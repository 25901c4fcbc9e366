"""One behaviour suite for the database port, run against SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import socket
from contextlib import AbstractAsyncContextManager

import asyncpg
import pytest

from apiary.db.base import Database, DatabaseUnavailable, Executor
from apiary.db.group import GroupCommit
from apiary.db.postgres import PostgresDatabase

ROUNDS = """
CREATE TABLE rounds (
    job_id TEXT NOT NULL,
    round BIGINT NOT NULL,
    state TEXT NOT NULL,
    loss DOUBLE PRECISION,
    PRIMARY KEY (job_id, round)
)
"""
CONTRIBUTIONS = """
CREATE TABLE contributions (
    job_id TEXT NOT NULL, round BIGINT NOT NULL, shard BIGINT NOT NULL, samples BIGINT NOT NULL,
    PRIMARY KEY (job_id, round, shard)
);
CREATE INDEX contributions_by_round ON contributions (job_id, round)
"""


async def test_migrations_are_versioned_per_component_and_idempotent(database: Database) -> None:
    # Execute
    first = await database.migrate("scheduler", [ROUNDS])
    again = await database.migrate("scheduler", [ROUNDS])
    grown = await database.migrate("scheduler", [ROUNDS, CONTRIBUTIONS])
    other = await database.migrate("aggregator", ["CREATE TABLE seen (id TEXT PRIMARY KEY)"])

    # Assert
    assert (first, again, grown, other) == (1, 0, 1, 1)
    versions = await database.fetch(
        "SELECT component, version FROM schema_migrations ORDER BY component, version"
    )
    assert versions == [
        {"component": "aggregator", "version": 1},
        {"component": "scheduler", "version": 1},
        {"component": "scheduler", "version": 2},
    ]


async def test_concurrent_migrations_apply_each_version_once(database: Database) -> None:
    # Execute
    migrations = [ROUNDS, CONTRIBUTIONS]
    applied = await asyncio.gather(*(database.migrate("scheduler", migrations) for _ in range(3)))

    # Assert
    assert sum(applied) == 2
    assert await database.fetchval("SELECT COUNT(*) FROM rounds") == 0


async def test_a_failing_migration_is_not_recorded_and_leaves_no_trace(database: Database) -> None:
    # Prepare
    broken = "CREATE TABLE half (id TEXT PRIMARY KEY); CREATE TABLE"

    # Execute
    with pytest.raises(Exception):  # noqa: B017 - each engine names its syntax error differently
        await database.migrate("tracker", [broken])

    # Assert
    recorded = "SELECT COUNT(*) FROM schema_migrations WHERE component = $1"
    assert await database.fetchval(recorded, "tracker") == 0
    assert await database.migrate("tracker", ["CREATE TABLE half (id TEXT PRIMARY KEY)"]) == 1


async def test_a_semicolon_inside_a_string_literal_does_not_split_a_migration(database: Database) -> None:
    # Prepare
    notes = """
    CREATE TABLE notes (id TEXT PRIMARY KEY, body TEXT NOT NULL);
    INSERT INTO notes (id, body) VALUES ('greeting', 'hello; world -- not a comment');
    INSERT INTO notes (id, body) VALUES ('quote', 'it''s; fine')
    """

    # Execute
    applied = await database.migrate("tracker", [notes])

    # Assert
    assert applied == 1
    rows = await database.fetch("SELECT id, body FROM notes ORDER BY id")
    assert rows == [{"id": "greeting", "body": "hello; world -- not a comment"}, {"id": "quote", "body": "it's; fine"}]


async def test_a_migration_with_a_body_of_statements_runs_whole(database: Database) -> None:
    # Prepare: a trigger (SQLite) or a PL/pgSQL function and its trigger (PostgreSQL); each body holds `;`.
    if database.dialect == "sqlite":
        body = """
        CREATE TRIGGER count_notes AFTER INSERT ON notes BEGIN
            UPDATE tally SET n = n + 1; UPDATE tally SET last = NEW.id;
        END
        """
    else:
        body = """
        CREATE FUNCTION count_notes() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            UPDATE tally SET n = n + 1; UPDATE tally SET last = NEW.id;
            RETURN NEW;
        END $$;
        CREATE TRIGGER count_notes AFTER INSERT ON notes FOR EACH ROW EXECUTE FUNCTION count_notes()
        """
    tables = ("CREATE TABLE notes (id TEXT PRIMARY KEY); CREATE TABLE tally (n BIGINT NOT NULL, last TEXT);"
              " INSERT INTO tally (n) VALUES (0)")

    # Execute
    applied = await database.migrate("tracker", [tables, body])
    await database.execute("INSERT INTO notes (id) VALUES ($1)", "a")
    await database.execute("INSERT INTO notes (id) VALUES ($1)", "b")

    # Assert
    assert applied == 2
    assert await database.fetchrow("SELECT n, last FROM tally") == {"n": 2, "last": "b"}


async def test_on_conflict_do_nothing_makes_a_duplicate_insert_a_no_op(database: Database) -> None:
    # Prepare
    await database.migrate("aggregator", [CONTRIBUTIONS])
    insert = (
        "INSERT INTO contributions (job_id, round, shard, samples) VALUES ($1, $2, $3, $4)"
        " ON CONFLICT DO NOTHING"
    )

    # Execute
    first = await database.execute(insert, "j1", 1, 0, 100)
    duplicate = await database.execute(insert, "j1", 1, 0, 999)

    # Assert
    assert (first, duplicate) == (1, 0)
    assert await database.fetch("SELECT samples FROM contributions") == [{"samples": 100}]


async def test_returning_gives_back_the_written_row_and_nothing_on_conflict(database: Database) -> None:
    # Prepare
    await database.migrate("scheduler", [ROUNDS])
    insert = (
        "INSERT INTO rounds (job_id, round, state) VALUES ($1, $2, $3)"
        " ON CONFLICT DO NOTHING RETURNING job_id, round, state"
    )

    # Execute
    created = await database.fetchrow(insert, "j1", 1, "running")
    duplicate = await database.fetchrow(insert, "j1", 1, "running")
    updated = await database.fetch(
        "UPDATE rounds SET state = $1 WHERE job_id = $2 RETURNING round, state", "aggregated", "j1"
    )

    # Assert
    assert created == {"job_id": "j1", "round": 1, "state": "running"}
    assert duplicate is None
    assert updated == [{"round": 1, "state": "aggregated"}]


async def test_execute_returns_how_many_rows_changed(database: Database) -> None:
    # Prepare
    await database.migrate("scheduler", [ROUNDS])
    insert = "INSERT INTO rounds (job_id, round, state) VALUES ($1, $2, $3)"
    for r in (1, 2, 3):
        await database.execute(insert, "j1", r, "open")

    # Execute
    updated = await database.execute("UPDATE rounds SET state = $1 WHERE round >= $2", "closed", 2)
    deleted = await database.execute("DELETE FROM rounds WHERE round = $1", 1)
    nothing = await database.execute("DELETE FROM rounds WHERE round = $1", 42)

    # Assert
    assert (updated, deleted, nothing) == (2, 1, 0)


async def test_fetchrow_and_fetchval_return_the_first_row_or_none(database: Database) -> None:
    # Prepare
    await database.migrate("scheduler", [ROUNDS])
    await database.execute(
        "INSERT INTO rounds (job_id, round, state, loss) VALUES ($1, $2, $3, $4)", "j1", 1, "done", 0.25
    )

    # Execute
    row = await database.fetchrow("SELECT job_id, loss FROM rounds WHERE round = $1", 1)
    missing_row = await database.fetchrow("SELECT job_id FROM rounds WHERE round = $1", 2)
    value = await database.fetchval("SELECT state FROM rounds WHERE job_id = $1", "j1")
    missing_value = await database.fetchval("SELECT state FROM rounds WHERE job_id = $1", "nope")

    # Assert
    assert row == {"job_id": "j1", "loss": 0.25}
    assert (missing_row, value, missing_value) == (None, "done", None)


async def test_the_same_python_values_are_accepted_and_read_back_alike(database: Database) -> None:
    # Prepare: an int for a DOUBLE PRECISION, a whole float for a BIGINT, a number for a TEXT.
    await database.migrate("scheduler", [ROUNDS])

    # Execute
    await database.execute(
        "INSERT INTO rounds (job_id, round, state, loss) VALUES ($1, $2, $3, $4)", 7, 3.0, "open", 2
    )
    await database.execute("UPDATE rounds SET loss = $1 WHERE round = $2", 1, 3)
    row = await database.fetchrow("SELECT job_id, round, state, loss FROM rounds WHERE job_id = $1", "7")

    # Assert
    assert row == {"job_id": "7", "round": 3, "state": "open", "loss": 1.0}
    assert row is not None
    assert [type(v) for v in row.values()] == [str, int, str, float]


async def test_a_transaction_commits_at_the_end_and_rolls_back_if_it_raises(database: Database) -> None:
    # Prepare
    await database.migrate("scheduler", [ROUNDS])
    insert = "INSERT INTO rounds (job_id, round, state) VALUES ($1, $2, $3)"

    # Execute
    async with database.transaction() as tx:
        await tx.execute(insert, "kept", 1, "open")
    with pytest.raises(RuntimeError, match="crash mid-transaction"):
        async with database.transaction() as tx:
            await tx.execute(insert, "lost", 1, "open")
            await tx.execute("UPDATE rounds SET state = $1 WHERE job_id = $2", "closed", "kept")
            raise RuntimeError("crash mid-transaction")

    # Assert
    assert await database.fetch("SELECT job_id, state FROM rounds") == [{"job_id": "kept", "state": "open"}]


async def test_a_failed_statement_rolls_back_the_whole_transaction(database: Database) -> None:
    # Prepare
    await database.migrate("scheduler", [ROUNDS])
    insert = "INSERT INTO rounds (job_id, round, state) VALUES ($1, $2, $3)"
    await database.execute(insert, "j1", 1, "open")

    # Execute
    with pytest.raises(Exception):  # noqa: B017 - a primary key violation, named per engine
        async with database.transaction() as tx:
            await tx.execute(insert, "j1", 2, "open")
            await tx.execute(insert, "j1", 1, "duplicate")

    # Assert
    assert await database.fetchval("SELECT COUNT(*) FROM rounds") == 1


async def test_concurrent_transactions_do_not_interleave(database: Database) -> None:
    # Prepare: a read-modify-write that loses updates if two transactions overlap.
    await database.migrate("aggregator", ["CREATE TABLE counter (id TEXT PRIMARY KEY, n BIGINT NOT NULL)"])
    await database.execute("INSERT INTO counter (id, n) VALUES ($1, $2)", "received", 0)

    async def receive_one() -> None:
        async with database.transaction() as tx:
            n = await tx.fetchval("SELECT n FROM counter WHERE id = $1", "received")
            await asyncio.sleep(0)  # give every other transaction the chance to step in here
            await tx.execute("UPDATE counter SET n = $1 WHERE id = $2", n + 1, "received")

    # Execute
    await asyncio.gather(*(receive_one() for _ in range(20)))

    # Assert
    assert await database.fetchval("SELECT n FROM counter WHERE id = $1", "received") == 20


async def test_postgres_refuses_a_fractional_float_for_an_integer_instead_of_truncating_it(
    postgres_url: str,
) -> None:
    # Prepare
    database = PostgresDatabase(postgres_url)
    await database.connect()
    await database.migrate("scheduler", [ROUNDS])

    insert = "INSERT INTO rounds (job_id, round, state) VALUES ($1, $2, $3)"

    # Execute / Assert
    try:
        with pytest.raises(ValueError, match=r"\$2 is 2.5"):
            await database.execute(insert, "j", 2.5, "x")
        assert await database.fetchval("SELECT COUNT(*) FROM rounds") == 0
    finally:
        await database.close()


async def test_postgres_a_connection_released_inside_a_transaction_goes_back_without_it(
    postgres_url: str,
) -> None:
    # Prepare: one pooled connection, released by a caller that left a transaction open.
    database = PostgresDatabase(postgres_url, min_size=1, max_size=1)
    await database.connect()
    await database.migrate("scheduler", [ROUNDS])
    try:
        async with database._connection() as conn:
            await conn.execute("BEGIN")
            await conn.execute("INSERT INTO rounds (job_id, round, state) VALUES ('j', 1, 'x')")

        # Execute
        async with database._connection() as conn:
            in_transaction = conn.is_in_transaction()

        # Assert: the next user gets a clean connection and the half-done insert is gone.
        assert not in_transaction
        assert await database.fetchval("SELECT COUNT(*) FROM rounds") == 0
    finally:
        await database.close()


async def test_postgres_connections_the_server_drops_are_unavailable_then_replaced(postgres_url: str) -> None:
    # Prepare
    database = PostgresDatabase(postgres_url)
    await database.connect()
    admin = await asyncpg.connect(postgres_url)
    name = postgres_url.rsplit("/", 1)[1]

    try:
        # Execute: the server ends every session of the database but the admin's.
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        outcomes: list[object] = []
        for _ in range(3):
            try:
                outcomes.append(await database.fetchval("SELECT 40 + 2"))
            except DatabaseUnavailable as e:
                outcomes.append(type(e))

        # Assert: at most the first call notices the loss; the pool then reconnects.
        assert outcomes[1:] == [42, 42]
        assert outcomes[0] in (42, DatabaseUnavailable)
    finally:
        await admin.close()
        await database.close()


async def test_an_unreachable_postgres_raises_database_unavailable_in_one_line() -> None:
    # Prepare: a port nothing listens on.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    database = PostgresDatabase(f"postgresql://postgres@127.0.0.1:{port}/apiary", connect_timeout=3)

    # Execute
    with pytest.raises(DatabaseUnavailable) as raised:
        await database.connect()

    # Assert
    message = str(raised.value)
    assert f"127.0.0.1:{port}/apiary" in message
    assert "\n" not in message


async def test_a_missing_postgres_database_raises_database_unavailable(postgres_url: str) -> None:
    # Prepare
    database = PostgresDatabase(postgres_url.rsplit("/", 1)[0] + "/apiary_no_such_database")

    # Execute / Assert
    with pytest.raises(DatabaseUnavailable, match="apiary_no_such_database"):
        await database.connect()


# ---------------------------------------------------------------- group commit


async def test_writes_waiting_together_share_a_transaction_in_arrival_order(database: Database) -> None:
    # Prepare: count the transactions opened.
    await database.migrate("tracker", [ROUNDS])
    opened = []
    real = database.transaction

    def counted() -> AbstractAsyncContextManager[Executor]:
        opened.append(1)
        return real()

    database.transaction = counted  # type: ignore[method-assign]

    async def apply(tx: Executor, n: int) -> None:
        await tx.execute("INSERT INTO rounds (job_id, round, state) VALUES ($1, $2, $3)", "j", n, "open")

    commits = GroupCommit(database, apply)

    # Execute: 40 handlers at once, as a consumer with a prefetch of 40 would run them.
    await asyncio.gather(*(commits.submit(n) for n in range(40)))

    # Assert: all stored, in order, in far fewer transactions than writes (the first alone, then the rest).
    assert [r["round"] for r in await database.fetch("SELECT round FROM rounds ORDER BY round")] == list(range(40))
    assert len(opened) <= 3, opened


async def test_a_write_that_fails_fails_alone_and_the_others_are_stored(database: Database) -> None:
    # Prepare
    await database.migrate("tracker", [ROUNDS])

    async def apply(tx: Executor, n: int) -> None:
        await tx.execute("INSERT INTO rounds (job_id, round, state) VALUES ($1, $2, $3)", "j", n, "open")
        if n == 7:
            raise ValueError("event 7 lacks what the tracker needs")

    commits = GroupCommit(database, apply)

    # Execute
    results = await asyncio.gather(*(commits.submit(n) for n in range(12)), return_exceptions=True)

    # Assert: only 7's waiter gets its error; 7's row was rolled back, every other row is stored.
    assert [type(r).__name__ if r else None for r in results] == [None] * 7 + ["ValueError"] + [None] * 4
    rounds = [r["round"] for r in await database.fetch("SELECT round FROM rounds ORDER BY round")]
    assert rounds == [n for n in range(12) if n != 7]


async def test_a_waiter_cancelled_mid_batch_leaves_the_others_to_commit(database: Database) -> None:
    # Prepare: the first transaction is held open, so that more writes queue behind it.
    await database.migrate("tracker", [ROUNDS])
    entered, release = asyncio.Event(), asyncio.Event()

    async def apply(tx: Executor, n: int) -> None:
        if n == 0:
            entered.set()
            await release.wait()
        await tx.execute("INSERT INTO rounds (job_id, round, state) VALUES ($1, $2, $3)", "j", n, "open")

    commits = GroupCommit(database, apply)
    first = asyncio.create_task(commits.submit(0))
    await entered.wait()
    queued = [asyncio.create_task(commits.submit(n)) for n in (1, 2, 3)]
    await asyncio.sleep(0)  # a turn of the loop: each queued task submits and waits

    # Execute: one queued waiter gives up (its service stops handling that message).
    queued[1].cancel()
    release.set()
    await asyncio.gather(first, queued[0], queued[2])

    # Assert: the others are committed; the cancelled one's write may or may not be (its message stays
    # unacknowledged and comes again, which the tracker tolerates).
    stored = {r["round"] for r in await database.fetch("SELECT round FROM rounds")}
    assert {0, 1, 3} <= stored
