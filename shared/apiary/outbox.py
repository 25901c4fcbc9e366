"""The transactional outbox: events are stored with the state change that causes them, in one
transaction, then published; a service that dies in between publishes them when it restarts.
Consumers are idempotent, so a message published twice does no harm.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Unpack

from pydantic import BaseModel

from apiary import telemetry
from apiary.bus import Bus
from apiary.bus.typed import Routing
from apiary.contracts import encode
from apiary.db import Database, Executor

log = logging.getLogger("apiary.outbox")

ROWS_PER_INSERT = 100  # 500 parameters: well under SQLite's and PostgreSQL's limits


@dataclass(frozen=True)
class Pending:
    """An event to queue: where it goes (its own routing key unless given), after how long, with
    which headers (the current trace context unless given)."""

    event: BaseModel
    routing_key: str | None = None
    delay: float | None = None
    headers: dict[str, Any] | None = None


def outbox_migration(table: str) -> str:
    """The DDL for a service's outbox table."""
    return (
        f"CREATE TABLE IF NOT EXISTS {table} ("
        " id {autoid}, routing_key TEXT NOT NULL, body TEXT NOT NULL, headers TEXT NOT NULL,"
        " deliver_at DOUBLE PRECISION, created_at DOUBLE PRECISION NOT NULL)"
    )


class Outbox:
    """A service's pending events, published in the order they were added."""

    def __init__(self, db: Database, bus: Bus, table: str) -> None:
        self._db, self._bus, self._table = db, bus, table
        self._lock = asyncio.Lock()

    async def add(self, tx: Executor, event: BaseModel, **routing: Unpack[Routing]) -> None:
        """Queue an event inside the caller's transaction (with the current trace context, unless
        `headers` are given)."""
        await self.add_all(tx, [Pending(event, **routing)])

    async def add_all(self, tx: Executor, events: Sequence[Pending]) -> None:
        """Queue several events in the caller's transaction, in this order, with few statements."""
        now = time.time()
        current = None
        rows: list[Any] = []
        for item in events:
            headers = item.headers
            if headers is None:
                current = telemetry.headers_for() if current is None else current
                headers = current
            rows.append((
                item.routing_key or getattr(item.event, "routing_key", ""),
                base64.b64encode(encode(item.event)).decode(),
                json.dumps(headers or {}),
                now + item.delay if item.delay else None,
                now,
            ))
        for start in range(0, len(rows), ROWS_PER_INSERT):
            chunk = rows[start : start + ROWS_PER_INSERT]
            values = ", ".join(f"(${5 * i + 1}, ${5 * i + 2}, ${5 * i + 3}, ${5 * i + 4}, ${5 * i + 5})"
                               for i in range(len(chunk)))
            await tx.execute(
                f"INSERT INTO {self._table} (routing_key, body, headers, deliver_at, created_at) VALUES {values}",
                *[value for row in chunk for value in row],
            )

    async def flush(self) -> int:
        """Publish every pending event, in the order added; return how many were published.

        The publishes go out together (the broker confirms them as a batch) and are deleted in one
        statement; any that failed stay for the next flush.
        """
        async with self._lock:
            rows = await self._db.fetch(
                f"SELECT id, routing_key, body, headers, deliver_at FROM {self._table} ORDER BY id"
            )
            if not rows:
                return 0
            results = await asyncio.gather(*(self._publish(row) for row in rows), return_exceptions=True)
            sent = [row["id"] for row, result in zip(rows, results, strict=True) if result is None]
            if sent:
                marks = ", ".join(f"${i}" for i in range(1, len(sent) + 1))
                await self._db.execute(f"DELETE FROM {self._table} WHERE id IN ({marks})", *sent)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return len(sent)

    async def _publish(self, row: dict[str, Any]) -> None:
        delay = None
        if row["deliver_at"] is not None:
            # Restarted publishers keep the original deadline, not a fresh full delay.
            delay = max(0.001, float(row["deliver_at"]) - time.time())
        await self._bus.publish(
            row["routing_key"],
            base64.b64decode(row["body"]),
            headers=json.loads(row["headers"]),
            delay=delay,
        )


class KeyedLocks:
    """One asyncio lock per key (a job), so a job's events are handled one at a time."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    def __call__(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock
