"""Group commit: writes that arrive while a transaction commits share the next one.

A consumer that stores every message before acknowledging it (the tracker sees every event) pays a
transaction per message: BEGIN, COMMIT and a flush of the database's log each time. Handlers run
concurrently (one per prefetched message), so under load several wait at once; here they wait for one
transaction that applies all of them, in arrival order. Nothing waits longer than it would alone: the
first write starts a transaction at once, and the next batch is whatever arrived meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from apiary.db.base import Database, Executor

T = TypeVar("T")

MAX_BATCH = 256


class GroupCommit(Generic[T]):
    """`await submit(item)` returns once `apply(tx, item)` is committed, or raises what it raised.

    A batch whose transaction fails is applied again item by item, each in its own transaction, so an
    item that cannot be stored fails alone and the others are stored as if it had never come."""

    def __init__(self, db: Database, apply: Callable[[Executor, T], Awaitable[None]],
                 after: Callable[[], Awaitable[None]] | None = None) -> None:
        self._db, self._apply, self._after = db, apply, after
        self._pending: list[tuple[T, asyncio.Future[None]]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> None:
        """Store the item with whatever else is waiting; return when it is committed."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain(), name="group-commit")
        await future

    async def _drain(self) -> None:
        batch: list[tuple[T, asyncio.Future[None]]] = []
        try:
            while self._pending:
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
                try:
                    await self._commit([item for item, _ in batch])
                except Exception:
                    await self._one_by_one(batch)
                else:
                    _settle(batch, None)
                if self._after is not None:
                    await self._after()
        except BaseException:
            # Cancelled (the service stops): no waiter may wait forever; their messages stay unacknowledged.
            for _, future in [*batch, *self._pending]:
                future.cancel()
            self._pending = []
            raise
        finally:
            self._drainer = None

    async def _commit(self, items: list[T]) -> None:
        async with self._db.transaction() as tx:
            for item in items:
                await self._apply(tx, item)

    async def _one_by_one(self, batch: list[tuple[T, asyncio.Future[None]]]) -> None:
        for item, future in batch:
            try:
                await self._commit([item])
            except Exception as e:
                _settle([(item, future)], e)
            else:
                _settle([(item, future)], None)


def _settle(batch: list[tuple[Any, asyncio.Future[None]]], error: Exception | None) -> None:
    for _, future in batch:
        if future.done():  # its waiter was cancelled (the service is stopping)
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
