"""The deployed database: PostgreSQL through an asyncpg pool.

Parameter types: asyncpg encodes each argument by the type the server inferred for its placeholder
and refuses, for instance, an int for a TEXT placeholder, which SQLite stores without a word. So
that the same SQL and the same Python values work on both, arguments are converted where nothing is
lost: a number for a text placeholder becomes its text (as SQLite's TEXT affinity stores it), an
int for a float placeholder a float, a whole float or a bool for an integer placeholder an int.
A fractional float for an integer placeholder raises ValueError: asyncpg would truncate it
silently. Other mismatches (a str for a number) are left to asyncpg, which says what it expected.

Transactions of one process run one at a time, as on SQLite, so a read-modify-write inside
`transaction()` cannot lose an update to another of the same process. Services in other processes
own other tables, so their transactions are not serialised against each other (a database-wide
lock would make every service wait on the busiest one); migrations alone take a transaction-scoped
advisory lock, so replicas starting together apply each version once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg

from apiary.db.base import Database, DatabaseUnavailable, Executor

T = TypeVar("T")

# Any constant works; this one is "apiary" in ASCII, so it is recognisable in pg_locks (migrations).
_TRANSACTION_LOCK = 0x617069617279

_INTEGER = frozenset({"int2", "int4", "int8"})
_FLOAT = frozenset({"float4", "float8"})
_TEXT = frozenset({"text", "varchar", "bpchar", "name"})

_UNAVAILABLE = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.InvalidCatalogNameError,
    asyncpg.exceptions.InvalidAuthorizationSpecificationError,
    asyncpg.exceptions.InvalidPasswordError,
)


def _where(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path or '/'}"


def _rows_changed(status: str) -> int:
    """The row count at the end of a command tag: 'INSERT 0 3' -> 3, 'CREATE TABLE' -> 0."""
    last = status.rsplit(" ", 1)[-1]
    return int(last) if last.isdigit() else 0


def _coerce(position: int, pg_type: str, value: Any) -> Any:
    if value is None:
        return None
    if pg_type in _INTEGER:
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"query argument ${position} is {value!r}, but its column is an integer")
            return int(value)
    elif pg_type in _FLOAT:
        if isinstance(value, int):
            return float(value)
    elif pg_type in _TEXT:
        if isinstance(value, bool):
            return str(int(value))
        if isinstance(value, int | float):
            return str(value)
    return value


class _Tx(Executor):
    def __init__(self, db: PostgresDatabase, conn: asyncpg.Connection) -> None:
        self._db, self._conn = db, conn

    async def execute(self, sql: str, *args: Any) -> int:
        return await self._db._execute_on(self._conn, sql, args)

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        return await self._db._fetch_on(self._conn, sql, args)

    async def execute_script(self, script: str) -> None:
        # Without arguments asyncpg sends the simple query protocol, which takes many statements.
        await self._db._execute_on(self._conn, script, ())


async def _reset(conn: asyncpg.Connection) -> None:
    """What a connection needs before it goes back to the pool. asyncpg's default resets session
    state (advisory locks, cursors, LISTEN, settings) in one more round trip per query; Apiary keeps
    none of those across a release (the migration lock is transaction-scoped), so only an open
    transaction, left by a cancelled caller, is rolled back."""
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


class PostgresDatabase(Database):
    """A PostgreSQL database shared by the services of a deployment."""

    migration_lock_sql = f"SELECT pg_advisory_xact_lock({_TRANSACTION_LOCK})"

    dialect = "postgresql"

    def __init__(
        self, url: str, *, min_size: int = 1, max_size: int = 10, connect_timeout: float = 10.0
    ) -> None:
        self.url = url
        self._min_size, self._max_size, self._connect_timeout = min_size, max_size, connect_timeout
        self._pool: asyncpg.Pool | None = None
        self._param_types: dict[str, tuple[str, ...]] = {}
        self._tx_lock = asyncio.Lock()

    def _unavailable(self, e: BaseException) -> DatabaseUnavailable:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        where = f"PostgreSQL at {_where(self.url)}"
        return DatabaseUnavailable(
            f"cannot use {where}: {reason}; check APIARY_DATABASE_URL and that the server is running",
            dependency=where, reason=reason,
        )

    async def connect(self) -> None:
        if self._pool is not None:
            return
        with self._classified():
            self._pool = await asyncpg.create_pool(
                self.url, min_size=self._min_size, max_size=self._max_size, timeout=self._connect_timeout,
                reset=_reset,
            )
        try:
            # Created here, under the lock, so that services migrating at once do not race on it.
            async with self.transaction() as tx:
                await tx.execute(self.migration_lock_sql)
                await tx.execute(
                    "CREATE TABLE IF NOT EXISTS schema_migrations ("
                    " component TEXT NOT NULL, version BIGINT NOT NULL,"
                    " PRIMARY KEY (component, version))"
                )
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    def _require(self) -> asyncpg.Pool:
        if self._pool is None:
            raise DatabaseUnavailable("PostgreSQL database is not connected",
                                      dependency=f"PostgreSQL at {_where(self.url)}", reason="not connected")
        return self._pool

    async def _args(self, conn: asyncpg.Connection, sql: str, args: Sequence[Any]) -> Sequence[Any]:
        if not args:
            return args
        types = self._param_types.get(sql)
        if types is None:
            statement = await conn.prepare(sql)
            types = tuple(t.name for t in statement.get_parameters())
            self._param_types[sql] = types
        return [_coerce(i, t, a) for i, (t, a) in enumerate(zip(types, args, strict=False), start=1)]

    @contextlib.contextmanager
    def _classified(self, conn: asyncpg.Connection | None = None) -> Iterator[None]:
        """A lost connection, whatever asyncpg calls it (an admin shutdown can surface as an
        InternalClientError or an InterfaceError), is the database being unavailable."""
        try:
            yield
        except DatabaseUnavailable:
            raise
        except Exception as e:
            if isinstance(e, _UNAVAILABLE) or (conn is not None and conn.is_closed()):
                raise self._unavailable(e) from e
            raise

    async def _run_on(self, conn: asyncpg.Connection, call: Callable[..., Awaitable[T]], sql: str,
                      args: Sequence[Any]) -> T:
        """`call` (conn.execute or conn.fetch) with the arguments converted."""
        with self._classified(conn):
            return await call(sql, *await self._args(conn, sql, args))

    async def _execute_on(self, conn: asyncpg.Connection, sql: str, args: Sequence[Any]) -> int:
        status: str = await self._run_on(conn, conn.execute, sql, args)
        return _rows_changed(status)

    async def _fetch_on(
        self, conn: asyncpg.Connection, sql: str, args: Sequence[Any]
    ) -> list[dict[str, Any]]:
        rows: list[asyncpg.Record] = await self._run_on(conn, conn.fetch, sql, args)
        return [dict(row) for row in rows]

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        pool = self._require()
        with self._classified():
            conn = await pool.acquire(timeout=self._connect_timeout)
        try:
            yield conn
        finally:
            # A connection the server dropped fails its reset; the pool replaces it, and the caller's
            # own error (or result) is what counts.
            with contextlib.suppress(*_UNAVAILABLE, asyncpg.exceptions.InterfaceError):
                await pool.release(conn)

    async def execute(self, sql: str, *args: Any) -> int:
        async with self._connection() as conn:
            return await self._execute_on(conn, sql, args)

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        async with self._connection() as conn:
            return await self._fetch_on(conn, sql, args)

    async def execute_script(self, script: str) -> None:
        async with self._connection() as conn:
            await self._execute_on(conn, script, ())

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Executor]:
        # The in-process lock keeps waiting transactions from holding pool connections.
        async with self._tx_lock, self._connection() as conn:
            tx = conn.transaction()
            with self._classified(conn):
                await tx.start()
            try:
                yield _Tx(self, conn)
            except BaseException:
                # Rolling back on a dead connection must not hide the error that caused it.
                with contextlib.suppress(*_UNAVAILABLE, asyncpg.exceptions.InterfaceError):
                    await tx.rollback()
                raise
            else:
                with self._classified(conn):
                    await tx.commit()

