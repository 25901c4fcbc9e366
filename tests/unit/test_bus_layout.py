"""The topology every process declares names each service's queue with exactly the patterns it consumes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from apiary import assignments
from apiary.bus import make_bus
from apiary.bus.base import Reroute, topic_matches
from apiary.bus.layout import SERVICE_QUEUES
from apiary.bus.memory import MemoryBus
from apiary.contracts import Assignment, ObjectRef, WorkerDone, WorkerFailed, report_key
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


def test_a_synchronous_rounds_reports_reach_the_aggregator_alone_and_mode_asyncs_the_scheduler_too() -> None:
    # Prepare: a round's assignment and a mode-async task's, and the reports of each.
    sync = Assignment(job_id="j", round=1, job_name="n", num_rounds=2, env={}, deadline=0.0)
    task = sync.model_copy(update={"asynchronous": True})
    done = WorkerDone(job_id="j", round=1, worker_id="w", shard=0, result=ObjectRef(key="k", size=1, sha256="0" * 64),
                      samples=1)
    failed = WorkerFailed(job_id="j", round=1, worker_id="w", shard=0, error="boom")

    # Execute
    keys = {(kind, mode): report_key(report, a) for kind, report in (("done", done), ("failed", failed))
            for mode, a in (("sync", sync), ("async", task))}

    def hears(service: str, key: str) -> bool:
        return any(topic_matches(pattern, key) for pattern in SERVICE_QUEUES[service])

    # Assert: the scheduler no longer pays for every synchronous report; every report reaches the aggregator
    # and the tracker.
    assert keys == {("done", "sync"): "worker.done", ("done", "async"): "worker.done.async",
                    ("failed", "sync"): "worker.failed", ("failed", "async"): "worker.failed.async"}
    for (_, mode), key in keys.items():
        assert hears("aggregator", key) and hears("tracker", key)
        assert hears("scheduler", key) == (mode == "async")
