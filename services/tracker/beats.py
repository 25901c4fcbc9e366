"""Heartbeats, written in batches. A worker beats every few seconds; a thousand workers' beats written one by
one cost two statements each in the tracker's transactions (a round of 1,000 contributions carried ~1,700 of
them, more the longer the round: the one cost that grew faster than K). The tracker keeps the latest beat of
each worker in memory and writes them all in one statement every WRITE_EVERY seconds, so a worker's row (its
last heartbeat, state, GPU readings) is at most that much older than its last beat.

A beat is presence that the next one replaces: it is acknowledged once kept, not once written (a tracker that
stops loses at most WRITE_EVERY seconds of beats, which the next beats make good). A row is never moved back:
a beat older than what the row already holds (the worker's `worker.done` or `worker.offline` recorded since,
by this tracker or another replica) changes nothing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pydantic import ValidationError

from apiary.bus import Poison
from apiary.component import to_json
from apiary.contracts import WorkerHeartbeat
from apiary.db import Database
from services.tracker import store
from services.tracker.store import WorkerSeen

log = logging.getLogger("apiary.tracker")

WRITE_EVERY = 1.0  # seconds between two writes of the beats kept meanwhile
ROWS_PER_STATEMENT = 500  # beats written by one statement (11 parameters each: under every database's limit)


def heartbeat_of(body: Mapping[str, Any]) -> WorkerHeartbeat:
    """A heartbeat message's event; Poison, naming the field, if a field has the wrong type (stricter than the
    contract, which would take a bool or a number's text for a number)."""
    worker_id = body.get("worker_id")
    if not isinstance(worker_id, str) or not worker_id:
        raise Poison("worker.heartbeat message lacks what the tracker needs: a worker_id string")
    fields: dict[str, type | tuple[type, ...]] = {"state": str, "job_id": str, "round": int, "shard": int,
                                                  "gpu": dict, "samples_per_s": (int, float), "kind": str,
                                                  "token": str, "interval": (int, float)}
    for name, kind in fields.items():
        value = body.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise Poison(f"worker.heartbeat message from {worker_id}: {name} has the wrong type "
                         f"({type(value).__name__})")
    try:
        return WorkerHeartbeat.model_validate(body)
    except ValidationError as e:
        raise Poison(f"worker.heartbeat message from {worker_id} is malformed: {e.errors()[0]['msg']} "
                     f"at {'.'.join(map(str, e.errors()[0]['loc']))}") from e


def beat_of(heartbeat: WorkerHeartbeat, ts: float) -> WorkerSeen:
    """What a heartbeat received at `ts` says of its worker's row."""
    return WorkerSeen(worker_id=heartbeat.worker_id, ts=ts, state=heartbeat.state, job_id=heartbeat.job_id,
                      round=heartbeat.round, shard=heartbeat.shard,
                      gpu=to_json(heartbeat.gpu) if heartbeat.gpu else None, samples_per_s=heartbeat.samples_per_s,
                      kind=heartbeat.kind)


class Heartbeats:
    """The latest beat of each worker not written yet, and the task that writes them every WRITE_EVERY s."""

    def __init__(self, db: Database, after: Callable[[], Awaitable[None]] | None = None) -> None:
        self._db, self._after = db, after
        self._pending: dict[str, WorkerSeen] = {}
        self._failing = False

    def keep(self, beat: WorkerSeen) -> None:
        """Keep a beat for the next write (an older one of the same worker is dropped)."""
        current = self._pending.get(beat.worker_id)
        if current is None or current.ts <= beat.ts:
            self._pending[beat.worker_id] = beat

    @property
    def pending(self) -> int:
        """Beats kept and not written yet."""
        return len(self._pending)

    async def write(self) -> int:
        """Write every beat kept so far (one statement per ROWS_PER_STATEMENT); how many. Should the write fail,
        the beats are kept for the next one (unless newer ones came meanwhile) and the error is raised."""
        beats, self._pending = list(self._pending.values()), {}
        if not beats:
            return 0
        try:
            async with self._db.transaction() as tx:
                for first in range(0, len(beats), ROWS_PER_STATEMENT):
                    await store.beats(tx, [b.row() for b in beats[first:first + ROWS_PER_STATEMENT]])
        except BaseException:
            for beat in beats:
                self.keep(beat)
            raise
        if self._after is not None:
            await self._after()
        return len(beats)

    async def run(self) -> None:
        """Write the beats every WRITE_EVERY seconds, until cancelled; a database away delays them (logged
        once, when it starts)."""
        while True:
            await asyncio.sleep(WRITE_EVERY)
            try:
                await self.write()
            except Exception as e:
                if not self._failing:
                    log.warning("tracker: %d heartbeats not written yet (%s); trying again every %.0f s",
                                self.pending, e, WRITE_EVERY)
                self._failing = True
            else:
                self._failing = False


__all__ = ["ROWS_PER_STATEMENT", "WRITE_EVERY", "Heartbeats", "beat_of", "heartbeat_of"]
