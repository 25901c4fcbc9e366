"""The transactional outbox: events are stored with the state change that causes them, in one
transaction, then published; a service that dies in between publishes them when it restarts, and
one whose broker is away publishes them from the background as soon as it is back.
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

from apiary import metrics, telemetry
from apiary.backoff import Backoff, while_unavailable
from apiary.bus import Bus
from apiary.bus.typed import Routing
from apiary.contracts import encode
from apiary.db import Database, Executor
from apiary.errors import DependencyUnavailable
from apiary.settings import Settings

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

    def __init__(self, db: Database, bus: Bus, table: str, *, retry: Backoff | None = None) -> None:
        self._db, self._bus, self._table = db, bus, table
        self._lock = asyncio.Lock()
        self._retry = retry or Settings().dependency_backoff()
        self._retrying: asyncio.Task[None] | None = None

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
        statement; any that failed stay for the next flush. If the broker (or the database) is away,
        the events stay and a flush in the background publishes them once it is back: the caller's
        committed work is neither undone nor held up by it. Any other failure is raised.
        """
        try:
            sent, error = await self._flush_once()
        except DependencyUnavailable as e:
            sent, error = 0, e
        if isinstance(error, DependencyUnavailable):
            self._flush_later(error)
        elif error is not None:
            raise error
        return sent

    async def close(self) -> None:
        """Stop the background flush, if one waits; the events it holds stay for the next start."""
        task, self._retrying = self._retrying, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _flush_once(self) -> tuple[int, BaseException | None]:
        """Publish what is pending; how many went out, and the first failure of those that did not."""
        async with self._lock:
            rows = await self._db.fetch(
                f"SELECT id, routing_key, body, headers, deliver_at FROM {self._table} ORDER BY id"
            )
            if not rows:
                metrics.outbox_backlog(self._table, 0)
                return 0, None
            results = await asyncio.gather(*(self._publish(row) for row in rows), return_exceptions=True)
            sent = [row["id"] for row, result in zip(rows, results, strict=True) if result is None]
            if sent:
                marks = ", ".join(f"${i}" for i in range(1, len(sent) + 1))
                await self._db.execute(f"DELETE FROM {self._table} WHERE id IN ({marks})", *sent)
            metrics.outbox_backlog(self._table, len(rows) - len(sent))
            failures = [r for r in results if isinstance(r, BaseException)]
            # A failure that waiting will not cure is the one to report.
            failures.sort(key=lambda r: isinstance(r, DependencyUnavailable))
            return len(sent), failures[0] if failures else None

    def _flush_later(self, error: DependencyUnavailable) -> None:
        if self._retrying is not None and not self._retrying.done():
            return
        log.warning("outbox %s: %s; its events are published once %s is back", self._table, error.reason,
                    error.dependency)
        self._retrying = asyncio.get_running_loop().create_task(self._flush_when_back(),
                                                                name=f"outbox:{self._table}")

    async def _flush_when_back(self) -> None:
        async def attempt() -> None:
            _, error = await self._flush_once()
            if error is not None:
                raise error

        try:
            await while_unavailable(attempt, self._retry, f"outbox {self._table}", log)
        except Exception as e:
            # Not a dependency: left for the next flush, which raises it to its caller.
            log.error("outbox %s: background flush failed: %s", self._table, e)

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
