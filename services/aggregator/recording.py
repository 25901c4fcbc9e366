"""Accepted contributions recorded in groups (group commit): one transaction carries every report of a round that
was taken in while the transaction before it committed.

A report's handler folds its contribution into the round's strategy under the job's lock, queues its row here and
waits for the commit outside the lock, so the next reports fold meanwhile: a round of K reports arriving together
costs a few commits, not K, one after the other (the database's transactions run one at a time in a process).
The delivery is acked only once its row is committed, as before; a handler cancelled while it waits cancels neither
the commit nor the other handlers of its group.

Should a commit fail, the contributions of that group and of every group queued behind it are in the strategy's
running sum but not in the database: their handlers fail (the broker delivers them again) and the round's state is
dropped, to be re-folded from the stored rows. Reading a round's rows (`drain` first) waits for what is queued, so
a state re-folded from them never misses a contribution that commits later. A report whose shard another aggregator
replica settled meanwhile (it was delivered to both) is stored as a duplicate and not counted again, rather than
failing its group.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from apiary.contracts import WorkerDone
from apiary.status import ContributionStatus
from services.aggregator.round_state import RoundKey
from services.aggregator.store import AggregatorStore, contribution_row

log = logging.getLogger("apiary.aggregator")


@dataclass
class _Group:
    """Reports of one round waiting for the same commit."""

    rows: list[tuple[Any, ...]] = field(default_factory=list)
    committed: asyncio.Future[int | None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class GroupRecorder:
    """Records accepted contributions a group per transaction, each round's groups one after another."""

    def __init__(self, store: AggregatorStore, on_failure: Callable[[RoundKey], None]) -> None:
        self._store = store
        self._on_failure = on_failure  # drops the round's state, whose sum holds uncommitted contributions
        self._queued: dict[RoundKey, _Group] = {}  # the next group of each round
        self._committing: dict[RoundKey, _Group] = {}  # the group in its transaction now
        self._writers: dict[RoundKey, asyncio.Task[None]] = {}

    def add(self, key: RoundKey, report: WorkerDone) -> Awaitable[int | None]:
        """Queue an accepted contribution's row; awaited, the round's settled-shard count once it is committed
        (raises what the commit raised). Cancelling that wait leaves the group's commit alone."""
        group = self._queued.get(key)
        if group is None:
            group = self._queued[key] = _Group()
        group.rows.append(contribution_row(report, ContributionStatus.ACCEPTED, None))  # in the report's own span
        if key not in self._writers:
            self._writers[key] = asyncio.create_task(self._write(key), name=f"record:{key[0]}:{key[1]}")
        return asyncio.shield(group.committed)  # shared by the group: one handler cancelled cancels no other

    async def drain(self, key: RoundKey) -> None:
        """Wait until every row queued for this round so far is committed; raise what a failed commit raised."""
        last = self._queued.get(key) or self._committing.get(key)  # groups commit in order: the last one says
        if last is not None:
            await asyncio.shield(last.committed)

    async def close(self) -> None:
        """Wait for the commits under way (the aggregator stops: their reports' deliveries are not acked, and are
        judged against the stored rows when delivered again)."""
        await asyncio.gather(*self._writers.values(), return_exceptions=True)

    async def _write(self, key: RoundKey) -> None:
        try:
            while (group := self._queued.pop(key, None)) is not None:
                self._committing[key] = group
                try:
                    settled = await self._store.record_settling(key, group.rows)
                except BaseException as e:
                    self._fail(key, group, e)
                    if not isinstance(e, Exception):
                        raise
                    return
                if not group.committed.done():
                    group.committed.set_result(settled)
        finally:
            self._committing.pop(key, None)
            self._writers.pop(key, None)

    def _fail(self, key: RoundKey, group: _Group, error: BaseException) -> None:
        """The group's rows are not stored: it and the groups queued behind it fail, and the round's state, whose
        sum holds them, is dropped (all before any other handler runs)."""
        failed = [group]
        if (queued := self._queued.pop(key, None)) is not None:
            failed.append(queued)
        count = sum(len(g.rows) for g in failed)
        log.warning("job %s: round %d: %d contribution(s) not recorded (%s); they are delivered again",
                    key[0], key[1], count, error)
        self._on_failure(key)
        for g in failed:
            if g.committed.done():
                continue
            if isinstance(error, Exception):
                g.committed.set_exception(error)
                g.committed.exception()  # retrieved: a group whose handlers all gave up is not logged as lost
            else:  # the writer was cancelled (the aggregator stops): so are its waiters
                g.committed.cancel()
