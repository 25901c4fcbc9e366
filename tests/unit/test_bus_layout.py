"""The topology every process declares names each service's queue with exactly the patterns it consumes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from apiary import assignments
from apiary.bus import make_bus
from apiary.bus.base import Reroute
from apiary.bus.layout import SERVICE_QUEUES
from apiary.bus.memory import MemoryBus
from apiary.db.sqlite import SqliteDatabase
from apiary.settings import Settings
from apiary.storage.local import LocalStorage
from services.aggregator import Aggregator
from services.scheduler.service import Scheduler
from services.sharder.service import Sharder
from services.tracker.service import Tracker


class _Recording(MemoryBus):
    """A memory bus that remembers the patterns each queue was bound with."""

    def __init__(self) -> None:
        super().__init__()
        self.bound: dict[str, set[str]] = {}

    async def declare_queue(self, name: str, bindings: Sequence[str], *, expires: float | None = None,
                            reroute: Reroute | None = None) -> None:
        self.bound.setdefault(name, set()).update(bindings)
        await super().declare_queue(name, bindings, expires=expires, reroute=reroute)


async def test_each_service_consumes_exactly_what_the_layout_binds(tmp_path: Path) -> None:
    # Prepare: the four services on a bus that declares nothing up front.
    bus = _Recording()
    db = SqliteDatabase(str(tmp_path / "apiary.db"))
    await bus.connect()
    await db.connect()
    settings = Settings(home=tmp_path / ".apiary")
    services = [cls(bus, db, LocalStorage(tmp_path / "store"), settings)
                for cls in (Scheduler, Sharder, Aggregator, Tracker)]

    # Execute
    try:
        for service in services:
            await service.start()
    finally:
        for service in reversed(services):
            await service.stop()
        await bus.close()
        await db.close()

    # Assert
    consumed = {name: patterns for name, patterns in bus.bound.items() if name != "dead"}
    assert consumed == {name: set(patterns) for name, patterns in SERVICE_QUEUES.items() if name != assignments.POOL}
    assert SERVICE_QUEUES[assignments.POOL] == (assignments.POOL,)


async def test_a_process_bus_declares_the_layout_before_anything_is_published() -> None:
    # Prepare
    bus = make_bus("memory://")

    # Execute: a job request published before any service started.
    await bus.connect()
    await bus.publish("job.requested", b"{}")

    # Assert: it waits in the scheduler's queue (and the tracker's), for the scheduler's first start.
    assert await bus.queue_size("scheduler") == 1
    assert await bus.queue_size("tracker") == 1
    await bus.close()
