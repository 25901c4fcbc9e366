"""The embedded database: one SQLite file, one connection, transactions serialised."""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiosqlite

from apiary.db.base import Database, DatabaseUnavailable, Executor

_PLACEHOLDER = re.compile(r"\$(\d+)")


def _sql(sql: str) -> str:
    return _PLACEHOLDER.sub(r"?\1", sql)


def statements(script: str) -> list[str]:
    """The statements of a script, each ended where SQLite's own parser ends it (sqlite3_complete)."""
    found: list[str] = []
    current = ""
    for piece in script.split(";"):
        current += piece
        if sqlite3.complete_statement(current + ";"):
            found.append(current.strip())
            current = ""
        else:
            current += ";"
    tail = current.removesuffix(";").strip()
    return [s for s in (*found, tail) if s]


class _Tx(Executor):
    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    async def execute(self, sql: str, *args: Any) -> int:
        cursor = await self._conn.execute(_sql(sql), args)
        return cursor.rowcount

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        cursor = await self._conn.execute(_sql(sql), args)
        rows = await cursor.fetchall()
        names = [d[0] for d in cursor.description or ()]
        return [dict(zip(names, row, strict=True)) for row in rows]

    async def execute_script(self, script: str) -> None:
        # Not executescript: it commits the open transaction first, and a migration must stay atomic.
        for statement in statements(script):
            await self._conn.execute(statement)


class SqliteDatabase(Database):
    """A SQLite file shared by every service of one process."""

    dialect = "sqlite"

    def __init__(self, path: str) -> None:
        self._path = path
        self._conn: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        if self._conn is not None:
            return
        if self._path not in ("", ":memory:"):
            Path(self._path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = await aiosqlite.connect(self._path or ":memory:", isolation_level=None)
        except sqlite3.Error as e:
            raise DatabaseUnavailable(f"cannot open SQLite database {self._path!r}: {e}",
                                      dependency=f"SQLite at {self._path!r}", reason=str(e)) from e
        await self._conn.execute("PRAGMA journal_mode=WAL")
        await self._conn.execute("PRAGMA busy_timeout=30000")
        await self._conn.execute("PRAGMA synchronous=NORMAL")

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    def _connection(self) -> aiosqlite.Connection:
        if self._conn is None:
            raise DatabaseUnavailable("SQLite database is not connected", dependency=f"SQLite at {self._path!r}",
                                      reason="not connected")
        return self._conn

    async def execute(self, sql: str, *args: Any) -> int:
        async with self._lock:
            return await _Tx(self._connection()).execute(sql, *args)

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        async with self._lock:
            return await _Tx(self._connection()).fetch(sql, *args)

    async def execute_script(self, script: str) -> None:
        async with self._lock:
            await _Tx(self._connection()).execute_script(script)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Executor]:
        async with self._lock:
            conn = self._connection()
            await conn.execute("BEGIN IMMEDIATE")
            try:
                yield _Tx(conn)
            except BaseException:
                await conn.execute("ROLLBACK")
                raise
            else:
                await conn.execute("COMMIT")
