"""The worker's presence: worker.online when it starts, a heartbeat at the fleet's pace (apiary.pace) while it
runs, worker.offline when it stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from apiary import metrics, proof
from apiary.bus import Bus, Delivery, Unroutable, publish_event
from apiary.contracts import PresencePace, WorkerHeartbeat, WorkerOffline, WorkerOnline
from apiary.pace import MAX_FACTOR
from apiary.settings import Settings
from services.worker.slot import Slot

log = logging.getLogger("apiary.worker")


class Presence:
    """Says that this worker is here, and what its slot does, every `beat_every` seconds."""

    def __init__(self, bus: Bus, settings: Settings, worker_id: str, slot: Slot,
                 gpu: Callable[[], dict[str, Any] | None]) -> None:
        self._bus, self._settings, self._worker_id, self._slot = bus, settings, worker_id, slot
        self._gpu = gpu  # the GPU's readings, as the training child that holds its memory sees them
        self._beating: asyncio.Task[None] | None = None
        self.beat_every = settings.heartbeat_interval  # stretched for a large fleet (apiary.pace)

    async def announce(self) -> None:
        """Say worker.online (if nobody listens yet, its heartbeats announce it)."""
        try:
            await publish_event(self._bus, WorkerOnline(worker_id=self._worker_id, hostname=socket.gethostname(),
                                                        gpu=self._gpu(), kind=self._settings.worker_kind))
        except Unroutable:
            log.warning("worker %s: no service listens for worker.online yet; heartbeats will announce it",
                        self._worker_id)

    def start(self) -> None:
        """Start beating."""
        self._beating = asyncio.create_task(self.beat(), name=f"heartbeat:{self._worker_id}")

    async def stop(self, reason: str) -> None:
        """Stop beating and say worker.offline, with why (a broker that is away misses it: the worker goes)."""
        if self._beating is not None:
            self._beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
        with contextlib.suppress(Exception):
            await publish_event(self._bus, WorkerOffline(worker_id=self._worker_id, reason=reason))

    async def beat(self) -> None:
        """A heartbeat every `beat_every` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.beat_every)
            with contextlib.suppress(Exception):
                # Not kept on the broker's disk: the next beat replaces a beat lost in a broker restart.
                await publish_event(self._bus, self.heartbeat(), persistent=False)

    def heartbeat(self) -> WorkerHeartbeat:
        """This worker's heartbeat now: what its slot runs, its throughput, its GPU and its pace."""
        a, slot, reading = self._slot.current, self._slot, self._gpu()
        metrics.gpu(self._worker_id, reading)
        return WorkerHeartbeat(
            worker_id=self._worker_id, state=slot.state, job_id=a.job_id if a else None,
            round=a.round if a else None, shard=a.shard if a else None,
            gpu=reading, samples_per_s=slot.samples_per_s,
            kind=self._settings.worker_kind, token=proof.progress_token(a.secret) if a and a.secret else None,
            interval=self.beat_every,
        )

    def pace(self, interval: float) -> None:
        """Beat every `interval` seconds from the next beat on, as the scheduler asks for the fleet's size
        (apiary.pace), never faster than this worker's own setting."""
        base = self._settings.heartbeat_interval
        self.beat_every = min(max(base, interval), base * MAX_FACTOR)

    async def on_pace(self, event: PresencePace, delivery: Delivery) -> None:
        """The fleet's heartbeat pace changed (or, sent to this worker alone, is not the one it beats at)."""
        self.pace(event.interval)
