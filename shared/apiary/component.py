"""What every service shares: its ports, its subscriptions, and a clean start and stop."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from apiary.bus import Bus, EventHandler, Raw, Subscription, subscribe
from apiary.db import Database
from apiary.settings import Settings
from apiary.storage import Storage


class Component:
    """A service: started with its ports, stopped by cancelling its consumers."""

    name = "component"

    def __init__(self, bus: Bus, db: Database, storage: Storage, settings: Settings | None = None) -> None:
        self.bus, self.db, self.storage = bus, db, storage
        self.settings = settings or Settings()
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        """Create tables, resume stored work, start consuming."""

    async def consume(self, queue: str, handlers: Mapping[str, EventHandler | Raw]) -> None:
        """Consume `queue` with this service's prefetch, waiting out a dependency that is away with this
        service's own backoff settings; stopped with the service."""
        self._subscriptions.append(await subscribe(self.bus, queue, handlers, prefetch=self.settings.prefetch,
                                                   retry=self.settings.dependency_backoff()))

    async def stop(self) -> None:
        """Stop consuming; unacked messages go back to their queues."""
        for sub in self._subscriptions:
            await sub.cancel()
        self._subscriptions.clear()


def to_json(value: Any) -> str:
    """JSON for a TEXT column."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def from_json(value: str | None, default: Any = None) -> Any:
    """A TEXT column's JSON, or `default` when NULL."""
    return default if value is None else json.loads(value)
