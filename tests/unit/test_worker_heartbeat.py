"""A worker's heartbeats are published not persistent (the broker keeps them in memory only: the next beat
replaces one lost in a broker restart), unlike its reports."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from apiary.bus import Delivery
from apiary.bus.memory import MemoryBus
from apiary.settings import Settings
from services.worker import Worker


async def test_heartbeats_are_published_not_persistent(tmp_path: Path) -> None:
    # Prepare: a queue that takes the worker's beats.
    bus = MemoryBus()
    await bus.connect()
    await bus.declare_queue("watch", ["worker.heartbeat"])
    seen: list[Delivery] = []
    got = asyncio.Event()

    async def record(delivery: Delivery) -> None:
        seen.append(delivery)
        got.set()

    subscription = await bus.consume("watch", record)
    worker = Worker(bus, Settings(home=tmp_path / ".apiary", heartbeat_interval=0.01), worker_id="w")

    # Execute: the worker beats until one beat arrives.
    beating = asyncio.create_task(worker.presence.beat())
    try:
        await asyncio.wait_for(got.wait(), 10)
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
        await subscription.cancel()
        await bus.close()

    # Assert
    assert seen[0].routing_key == "worker.heartbeat" and seen[0].persistent is False
