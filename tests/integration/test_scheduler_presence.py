"""The scheduler's view of which workers are online (SQLite and PostgreSQL): a worker's own reports count;
one sent by another worker's broker user does not make it look online or gone."""

from __future__ import annotations

import time
from pathlib import Path

from apiary.bus.identity import worker_user
from apiary.bus.memory import MemoryBus
from apiary.bus.typed import publish_event
from apiary.contracts import WorkerHeartbeat, WorkerOffline, WorkerOnline
from apiary.db import Database
from apiary.settings import Settings
from apiary.storage.local import LocalStorage
from services.scheduler import Scheduler, store


async def _online(database: Database) -> set[str]:
    return set(await store.online_workers(database, time.time() - 60))


async def test_presence_counts_only_from_the_workers_own_broker_user(database: Database, tmp_path: Path) -> None:
    # Prepare
    bus = MemoryBus()
    await bus.connect()
    scheduler = Scheduler(bus, database, LocalStorage(tmp_path / "store"), Settings())
    await scheduler.start()
    w1, w2 = bus.as_user(worker_user("w1")), bus.as_user(worker_user("w2"))
    try:
        # Execute: w2 announces itself; w1's user speaks for w3 (online) and for w2 (offline)
        await publish_event(w2, WorkerOnline(worker_id="w2"))
        await publish_event(w1, WorkerOnline(worker_id="w3"))
        await publish_event(w1, WorkerHeartbeat(worker_id="w3"))
        await publish_event(w1, WorkerOffline(worker_id="w2"))
        await publish_event(w1, WorkerOnline(worker_id="w1"))
        await bus.wait_idle()  # every report handled (they are handled concurrently, in no fixed order)
        online = await _online(database)
    finally:
        await scheduler.stop()
        await bus.close()

    # Assert: the genuine reports counted, the ones sent for another worker did not
    assert online == {"w1", "w2"}
