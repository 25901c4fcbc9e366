"""A component's tables in the tracker's database, created on first use: the API's routes may be served by
an in-process tracker that was never started (the CLI over `.apiary/`), so they cannot rely on start()."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from apiary.db import Database


class LazyTables:
    """Runs a component's migrations once, the first time its tables are needed."""

    def __init__(self, db: Database, component: str, migrations: Sequence[str]) -> None:
        self._db, self._component, self._migrations = db, component, migrations
        self._migrated = asyncio.Lock()
        self._ready = False

    async def ready(self) -> Database:
        """The database, the component's tables created."""
        async with self._migrated:
            if not self._ready:
                await self._db.migrate(self._component, self._migrations)
                self._ready = True
        return self._db


__all__ = ["LazyTables"]
