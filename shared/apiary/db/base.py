"""What every database adapter provides.

SQL is written once, in the subset both engines share: `$1` placeholders, TEXT, BIGINT,
DOUBLE PRECISION, `ON CONFLICT ... DO NOTHING`, `RETURNING`. JSON is stored as TEXT.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from apiary.errors import DependencyUnavailable

# `{autoid}` in a migration becomes an auto-incrementing primary key in each dialect.
AUTOID = {
    "sqlite": "INTEGER PRIMARY KEY AUTOINCREMENT",
    "postgresql": "BIGSERIAL PRIMARY KEY",
    "postgres": "BIGSERIAL PRIMARY KEY",
}


class DatabaseUnavailable(DependencyUnavailable):
    """The database cannot be reached now (down, restarting, refusing connections); the caller may retry later."""


class Executor(ABC):
    """Something that runs SQL: the database itself, or one open transaction."""

    @abstractmethod
    async def execute(self, sql: str, *args: Any) -> int:
        """Run a statement; return the number of rows it changed."""

    @abstractmethod
    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        """Run a query; return its rows as dicts."""

    @abstractmethod
    async def execute_script(self, script: str) -> None:
        """Run statements separated by `;`, split where the engine's own parser ends each one (so a `;`
        inside a string literal, a trigger or a function body stays where it is)."""

    async def fetchrow(self, sql: str, *args: Any) -> dict[str, Any] | None:
        """Run a query; return its first row, or None."""
        rows = await self.fetch(sql, *args)
        return rows[0] if rows else None

    async def fetchval(self, sql: str, *args: Any) -> Any:
        """Run a query; return the first column of its first row, or None."""
        row = await self.fetchrow(sql, *args)
        return next(iter(row.values())) if row else None


class Database(Executor):
    """A connection pool (or file) with transactions and versioned migrations."""

    dialect: str = ""
    # A statement that makes concurrent migrations (from other processes) wait their turn.
    migration_lock_sql: str | None = None

    @abstractmethod
    async def connect(self) -> None:
        """Open the database (and create the migrations table)."""

    @abstractmethod
    async def close(self) -> None:
        """Close every connection."""

    @abstractmethod
    def transaction(self) -> AbstractAsyncContextManager[Executor]:
        """A transaction: committed when the block ends, rolled back if it raises."""

    async def migrate(self, component: str, migrations: Sequence[str]) -> int:
        """Apply the component's migrations not yet applied, in order; return how many ran."""
        async with self.transaction() as tx:
            if self.migration_lock_sql:
                await tx.execute(self.migration_lock_sql)
            await tx.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " component TEXT NOT NULL, version BIGINT NOT NULL,"
                " PRIMARY KEY (component, version))"
            )
        applied = 0
        for version, script in enumerate(migrations, start=1):
            async with self.transaction() as tx:
                if self.migration_lock_sql:
                    await tx.execute(self.migration_lock_sql)
                done = await tx.fetchval(
                    "SELECT version FROM schema_migrations WHERE component = $1 AND version = $2",
                    component,
                    version,
                )
                if done is not None:
                    continue
                await tx.execute_script(script.replace("{autoid}", AUTOID.get(self.dialect, AUTOID["postgresql"])))
                await tx.execute(
                    "INSERT INTO schema_migrations (component, version) VALUES ($1, $2)"
                    " ON CONFLICT DO NOTHING",
                    component,
                    version,
                )
                applied += 1
        return applied
