"""The tracker component: consumes every event (`#`) into its views, serves them over HTTP, and marks
workers offline when their heartbeats stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from apiary.bus import Delivery, Poison, Raw
from apiary.component import Component
from apiary.contracts import DecodeError, PresencePace, RoundStart, WorkerHeartbeat, decode_body
from apiary.db import Executor
from apiary.db.group import GroupCommit
from apiary.http_server import HttpServer
from apiary.pace import PaceWindow
from services.tracker import async_views, forgery, store
from services.tracker.beats import Heartbeats, beat_of
from services.tracker.experiments import Experiments
from services.tracker.forgery import WorkerReport
from services.tracker.handlers import VIEWS, decoded, summary

log = logging.getLogger("apiary.tracker")


@dataclass(frozen=True)
class Arrival:
    """One event waiting for the group commit: its routing key, its body (the event log keeps it), what its view
    takes of it (`handlers.decoded`), when it came and the broker user that sent it."""

    key: str
    body: dict[str, Any]
    event: Any
    ts: float
    user_id: str | None


class Tracker(Component):
    """Keeps what a person watching a job wants to see, from the events alone."""

    name = "tracker"

    def __init__(self, *args: Any, http: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sweeper: asyncio.Task[None] | None = None
        self._pace = PaceWindow(self.settings.worker_offline_after)
        self._commits = GroupCommit(self.db, self._apply, after=self._notify)
        self._beats = Heartbeats(self.db, after=self._notify)
        self._beat_writer: asyncio.Task[None] | None = None
        self._digests = forgery.KnownDigests()
        self._read: dict[int, list[tuple[forgery.ShardKey, Any]]] = {}  # by id(arrival): digest rows it read
        self.changed = asyncio.Condition()
        # Bumped with every notification, so a waiter can tell whether it missed one.
        self.version = 0
        self.closing = asyncio.Event()
        self.serve_http = http
        self._http: HttpServer | None = None
        # MLflow and TensorBoard, fed from the applied events (none unless the settings ask).
        self.experiments = Experiments([])

    @property
    def http_url(self) -> str | None:
        """The HTTP API's and dashboard's address while they are served, else None."""
        return self._http.url if self._http is not None else None

    async def start(self) -> None:
        self.closing.clear()
        await self.db.migrate(self.name, store.MIGRATIONS)
        await self.db.migrate(async_views.COMPONENT, async_views.MIGRATIONS)
        await self._start_experiments()  # before the first event is applied
        await self.consume("tracker", {"#": Raw(self.on_event)})
        self._sweeper = asyncio.create_task(self._sweep_offline(), name="tracker:offline-sweep")
        self._beat_writer = asyncio.create_task(self._beats.run(), name="tracker:heartbeats")
        if self.serve_http:
            await self.start_http()

    async def start_http(self, host: str | None = None, port: int | None = None) -> str:
        """Serve the HTTP API and the dashboard (on the settings' host and port unless given; port 0
        picks a free one) and return their address. Call after start()."""
        from services.tracker.api import create_app

        if self._http is not None:
            return self._http.url
        server = HttpServer(create_app(self), self.settings.http_host if host is None else host,
                            self.settings.http_port if port is None else port)
        url = await server.start()
        self._http = server
        log.info("tracker serving the API and dashboard on %s", url)
        return url

    async def stop(self) -> None:
        self.closing.set()
        await self._notify()  # live streams end, so the HTTP server can stop promptly
        if self._http is not None:
            await self._http.stop()
            self._http = None
        await super().stop()
        for task in (self._sweeper, self._beat_writer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sweeper = self._beat_writer = None
        with contextlib.suppress(Exception):
            await self._beats.write()  # the beats kept since the last write
        await self.experiments.close()

    async def _start_experiments(self) -> None:
        if not (self.settings.mlflow_tracking_uri or self.settings.tensorboard):
            return
        from services.tracker.experiment_sinks import sinks_of

        sinks = await asyncio.to_thread(sinks_of, self.settings, self.storage)  # importing mlflow takes seconds
        self.experiments = Experiments(sinks)
        self.experiments.start()

    async def _notify(self) -> None:
        async with self.changed:
            self.version += 1
            self.changed.notify_all()

    async def on_event(self, delivery: Delivery) -> None:
        """Record one event and update the views it touches (stored before the bus acknowledges it)."""
        try:
            body = decode_body(delivery.body, delivery.content_type)
        except DecodeError as e:
            raise Poison(str(e)) from e
        key, now = delivery.routing_key, time.time()
        event = decoded(key, body)
        if isinstance(event, PresencePace):
            self._pace.hear(event.factor, now)
            if key != PresencePace.routing_key:
                return  # the pace told to one worker: the fleet's, recorded when it was announced
        elif isinstance(event, WorkerHeartbeat):
            self._pace.hear_interval(event.interval, self.settings.heartbeat_interval, now)
            if forgery.shard_of(event) is None and forgery.judge(event, None, delivery.user_id) is None:
                # A beat naming no shard changes only its worker's row: kept for the next batched write.
                self._beats.keep(beat_of(event, now))
                return
        arrival = Arrival(key, body, event, now, delivery.user_id)
        try:
            await self._commits.submit(arrival)
        finally:
            read = self._read.pop(id(arrival), [])
        self._digests.keep(read)  # read in a transaction that committed

    async def _apply(self, tx: Executor, arrival: Arrival) -> None:
        """Log one event and apply it to the views, in the group commit's transaction (a forged worker
        report is recorded as such, and applied to nothing)."""
        key, body, event, ts = arrival.key, arrival.body, arrival.event, arrival.ts
        if key != WorkerHeartbeat.routing_key:
            job_id = body.get("job_id") if isinstance(body.get("job_id"), str) else None
            round_index = body.get("round") if isinstance(body.get("round"), int) else None
            await store.record_event(tx, ts, key, job_id, round_index, summary(key, body))
        view = VIEWS.get(key)
        if view is None or (isinstance(event, WorkerReport) and await forgery.forged(
                tx, event, arrival.user_id, ts, self._digests, self._read.setdefault(id(arrival), []))):
            return
        try:
            await view(tx, event, ts)
        except ValueError as e:
            raise Poison(f"{key} message lacks what the tracker needs: {e}") from e
        self.experiments.hear(key, event, ts)
        if isinstance(event, RoundStart):
            # The digests its view stored, known once this commits: the round's reports need not read them back.
            self._read.setdefault(id(arrival), []).extend(forgery.announced(event))
        if isinstance(event, WorkerHeartbeat):
            self._beats.keep(beat_of(event, ts))  # its worker's row, with the next batched write

    async def _sweep_offline(self) -> None:
        """Mark workers offline when their heartbeats stop."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            now = time.time()
            cutoff = now - self._pace.offline_after(now)  # stretched for a large fleet (apiary.pace)
            with contextlib.suppress(Exception):
                await self._beats.write()  # the beats kept since the last write count
                changed = await store.mark_silent_offline(self.db, cutoff)
                if changed:
                    await self._notify()


__all__ = ["Tracker"]
