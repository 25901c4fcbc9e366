"""The bus, database and storage a process uses, chosen by its settings."""

from __future__ import annotations

from apiary.bus import Bus, make_bus
from apiary.db import Database, make_database
from apiary.settings import Settings
from apiary.storage import Storage, make_storage


class Ports:
    """The bus, database and storage a process uses, chosen by its settings."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.bus: Bus = make_bus(settings.resolved_bus_url(), exchange=settings.exchange,
                                 queue_type=settings.queue_type, delivery_limit=settings.queue_delivery_limit)
        self.db: Database = make_database(settings.resolved_database_url())
        self.storage: Storage = make_storage(settings.resolved_storage_url(), endpoint_url=settings.s3_endpoint_url,
                                             region=settings.s3_region)

    async def open(self) -> None:
        """Connect to the bus and the database."""
        await self.bus.connect()
        await self.db.connect()

    async def close(self) -> None:
        """Disconnect."""
        await self.bus.close()
        await self.db.close()


__all__ = ["Ports"]
