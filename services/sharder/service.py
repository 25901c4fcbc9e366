"""The sharder component: its ports, its subscription, and a clean start and stop."""

from __future__ import annotations

from typing import Any

from apiary.component import Component
from apiary.outbox import Outbox
from services.sharder.handlers import ShardHandlers
from services.sharder.store import MIGRATIONS, OUTBOX


class Sharder(Component):
    """Splits datasets into shards, seeded, and stores them under the job's prefix."""

    name = "sharder"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbox = Outbox(self.db, self.bus, OUTBOX)
        self.handlers = ShardHandlers(self.db, self.storage, self.outbox)

    async def start(self) -> None:
        """Migrate, publish what an earlier run left in the outbox, and start consuming."""
        await self.db.migrate(self.name, MIGRATIONS)
        await self.outbox.flush()
        await self.consume("sharder", {"shard.requested": self.handlers.on_shard_requested})

    async def stop(self) -> None:
        """Stop consuming, then the outbox's background flush (its events stay stored)."""
        await super().stop()
        await self.outbox.close()
