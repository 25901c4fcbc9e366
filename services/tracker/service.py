"""Tracker handlers: every event (`#`) -> event log, job views, worker table, metric series."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from apiary.bus import Delivery, Poison, Raw, subscribe
from apiary.component import Component, to_json
from apiary.contracts import DecodeError, decode_body
from apiary.db.group import GroupCommit
from services.tracker.http import HttpServer
from services.tracker.views import TERMINAL, job_view

log = logging.getLogger("apiary.tracker")

MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS events (
      seq {autoid}, ts DOUBLE PRECISION NOT NULL, routing_key TEXT NOT NULL, job_id TEXT,
      round BIGINT, body TEXT NOT NULL);
    CREATE INDEX IF NOT EXISTS events_job ON events (job_id, seq);
    CREATE TABLE IF NOT EXISTS job_views (
      job_id TEXT PRIMARY KEY, name TEXT, status TEXT NOT NULL, round BIGINT NOT NULL DEFAULT 0,
      attempt BIGINT NOT NULL DEFAULT 0, num_rounds BIGINT, num_shards BIGINT, reason TEXT,
      errors TEXT, final_model TEXT, metrics TEXT, created_at DOUBLE PRECISION NOT NULL,
      updated_at DOUBLE PRECISION NOT NULL);
    CREATE TABLE IF NOT EXISTS round_views (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL, status TEXT NOT NULL,
      metrics TEXT, reason TEXT, started_at DOUBLE PRECISION, ended_at DOUBLE PRECISION,
      PRIMARY KEY (job_id, round, attempt));
    CREATE TABLE IF NOT EXISTS shard_views (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL, shard BIGINT NOT NULL,
      worker_id TEXT, state TEXT NOT NULL, metrics TEXT, error TEXT, updated_at DOUBLE PRECISION NOT NULL,
      PRIMARY KEY (job_id, round, attempt, shard));
    CREATE TABLE IF NOT EXISTS workers (
      worker_id TEXT PRIMARY KEY, hostname TEXT, status TEXT NOT NULL, state TEXT,
      job_id TEXT, round BIGINT, shard BIGINT, gpu TEXT, samples_per_s DOUBLE PRECISION,
      first_seen DOUBLE PRECISION NOT NULL, last_seen DOUBLE PRECISION NOT NULL);
    CREATE TABLE IF NOT EXISTS metrics (
      seq {autoid}, job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL,
      worker_id TEXT NOT NULL, shard BIGINT NOT NULL, step BIGINT, name TEXT NOT NULL,
      value DOUBLE PRECISION NOT NULL, ts DOUBLE PRECISION NOT NULL);
    CREATE INDEX IF NOT EXISTS metrics_job ON metrics (job_id, seq)
    """,
    # The step a shard's training reached, for the per-worker progress table.
    "ALTER TABLE shard_views ADD COLUMN step BIGINT",
]


class Tracker(Component):
    """Keeps what a person watching a job wants to see, from the events alone."""

    name = "tracker"

    def __init__(self, *args: Any, http: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sweeper: asyncio.Task[None] | None = None
        self._commits = GroupCommit(self.db, self._apply, after=self._notify)
        self.changed = asyncio.Condition()
        # Bumped with every notification, so a waiter can tell whether it missed one.
        self.version = 0
        self.closing = asyncio.Event()
        self.serve_http = http
        self._http: HttpServer | None = None

    @property
    def http_url(self) -> str | None:
        """The HTTP API's and dashboard's address while they are served, else None."""
        return self._http.url if self._http is not None else None

    async def start(self) -> None:
        self.closing.clear()
        await self.db.migrate(self.name, MIGRATIONS)
        self._subscriptions.append(
            await subscribe(self.bus, "tracker", {"#": Raw(self.on_event)}, prefetch=self.settings.prefetch)
        )
        self._sweeper = asyncio.create_task(self._sweep_offline(), name="tracker:offline-sweep")
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
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

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
        await self._commits.submit((delivery.routing_key, body, time.time()))

    async def _apply(self, tx: Any, event: tuple[str, dict[str, Any], float]) -> None:
        key, body, ts = event
        job_id = body.get("job_id") if isinstance(body.get("job_id"), str) else None
        round_index = body.get("round") if isinstance(body.get("round"), int) else None
        if key != "worker.heartbeat":
            await tx.execute("INSERT INTO events (ts, routing_key, job_id, round, body) VALUES ($1, $2, $3, $4, $5)",
                             ts, key, job_id, round_index, to_json(_summary(key, body)))
        handler = _VIEWS.get(key)
        if handler is not None:
            try:
                await handler(tx, body, ts)
            except (KeyError, TypeError, ValueError) as e:
                raise Poison(f"{key} message lacks what the tracker needs: {e}") from e

    async def _sweep_offline(self) -> None:
        """Mark workers offline when their heartbeats stop."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            cutoff = time.time() - self.settings.worker_offline_after
            with contextlib.suppress(Exception):
                changed = await self.db.execute(
                    "UPDATE workers SET status = 'offline' WHERE status = 'online' AND last_seen < $1", cutoff
                )
                if changed:
                    await self._notify()


SHARD_ROWS_PER_INSERT = 500  # well under SQLite's and PostgreSQL's limits on parameters per statement


def _summary(key: str, body: dict[str, Any]) -> dict[str, Any]:
    # Assignments carry presigned URLs: credentials do not belong in an event log.
    if key.startswith("assign."):
        return {k: v for k, v in body.items() if not k.endswith("_url")}
    return body


async def _job_requested(tx: Any, b: dict[str, Any], ts: float) -> None:
    if not isinstance(b.get("job_id"), str):
        return
    await tx.execute(
        "INSERT INTO job_views (job_id, name, status, num_rounds, created_at, updated_at)"
        " VALUES ($1, $2, 'requested', $3, $4, $4) ON CONFLICT DO NOTHING",
        b["job_id"], str(b.get("name", "")), (b.get("distributed") or {}).get("num_rounds"), ts,
    )


async def _job_accepted(tx: Any, b: dict[str, Any], ts: float) -> None:
    await _ensure_job(tx, b["job_id"], ts)
    await tx.execute(
        "UPDATE job_views SET name = $2, num_rounds = $3, num_shards = $4, updated_at = $5,"
        # A job can end before its acceptance is seen here (cancelled before it started, say).
        " status = CASE WHEN status IN ('completed', 'failed', 'cancelled', 'rejected') THEN status"
        " ELSE 'sharding' END"
        " WHERE job_id = $1",
        b["job_id"], b["name"], b["num_rounds"], b["num_shards"], ts,
    )


async def _job_rejected(tx: Any, b: dict[str, Any], ts: float) -> None:
    await _ensure_job(tx, b["job_id"], ts)
    await tx.execute(
        "UPDATE job_views SET status = 'rejected', reason = $2, errors = $3, updated_at = $4 WHERE job_id = $1",
        b["job_id"], b["reason"], to_json(b.get("errors", [])), ts,
    )


async def _round_start(tx: Any, b: dict[str, Any], ts: float) -> None:
    await _ensure_job(tx, b["job_id"], ts)
    await tx.execute(
        "UPDATE job_views SET status = 'running', reason = NULL, round = $2, attempt = $3, num_rounds = $4,"
        " updated_at = $5"
        " WHERE job_id = $1 AND status NOT IN ('completed', 'failed', 'cancelled')",
        b["job_id"], b["round"], b["attempt"], b["num_rounds"], ts,
    )
    await tx.execute(
        "INSERT INTO round_views (job_id, round, attempt, status, started_at) VALUES ($1, $2, $3, 'running', $4)"
        " ON CONFLICT DO NOTHING",
        b["job_id"], b["round"], b["attempt"], ts,
    )
    shards = [int(shard) for shard in b["shards"]]
    for start in range(0, len(shards), SHARD_ROWS_PER_INSERT):
        chunk = shards[start : start + SHARD_ROWS_PER_INSERT]
        rows = ", ".join(f"($1, $2, $3, ${i}, 'assigned', $4)" for i in range(5, 5 + len(chunk)))
        await tx.execute(
            f"INSERT INTO shard_views (job_id, round, attempt, shard, state, updated_at) VALUES {rows}"
            " ON CONFLICT DO NOTHING",
            b["job_id"], b["round"], b["attempt"], ts, *chunk,
        )


async def _shard_state(tx: Any, b: dict[str, Any], ts: float, state: str, error: str | None = None) -> None:
    # A progress report that arrives after the shard's result must not turn it back into "training".
    settled = "AND state NOT IN ('reported', 'failed', 'rejected')" if state == "training" else ""
    await tx.execute(
        "UPDATE shard_views SET worker_id = $5, state = $6, metrics = COALESCE($7, metrics),"
        " error = $8, step = COALESCE($9, step), updated_at = $10"
        f" WHERE job_id = $1 AND round = $2 AND attempt = $3 AND shard = $4 {settled}",
        b["job_id"], b["round"], b.get("attempt", 1), b["shard"], b["worker_id"], state,
        to_json(b["metrics"]) if b.get("metrics") else None, error,
        b.get("step") if isinstance(b.get("step"), int) else None, ts,
    )


async def _worker_progress(tx: Any, b: dict[str, Any], ts: float) -> None:
    await _shard_state(tx, b, ts, "training")
    for name, value in (b.get("metrics") or {}).items():
        await tx.execute(
            "INSERT INTO metrics (job_id, round, attempt, worker_id, shard, step, name, value, ts)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            b["job_id"], b["round"], b.get("attempt", 1), b["worker_id"], b["shard"], b.get("step"), name,
            float(value), b.get("ts", ts),
        )
    await _touch_worker(tx, b["worker_id"], ts, state="training", job_id=b["job_id"], round_index=b["round"],
                        shard=b["shard"], samples_per_s=b.get("samples_per_s"))


async def _worker_done(tx: Any, b: dict[str, Any], ts: float) -> None:
    await _shard_state(tx, b, ts, "reported")
    await _touch_worker(tx, b["worker_id"], ts, state="idle")


async def _worker_failed(tx: Any, b: dict[str, Any], ts: float) -> None:
    await _shard_state(tx, b, ts, "failed", error=b.get("error"))
    await _touch_worker(tx, b["worker_id"], ts, state="idle")


async def _round_aggregated(tx: Any, b: dict[str, Any], ts: float) -> None:
    await tx.execute(
        "UPDATE round_views SET status = 'aggregated', metrics = $4, ended_at = $5"
        " WHERE job_id = $1 AND round = $2 AND attempt = $3 AND status = 'running'",
        b["job_id"], b["round"], b["attempt"], to_json(b.get("metrics", {})), ts,
    )
    for shard, reason in (b.get("rejected") or {}).items():
        await tx.execute(
            "UPDATE shard_views SET state = 'rejected', error = $5 WHERE job_id = $1 AND round = $2"
            " AND attempt = $3 AND shard = $4",
            b["job_id"], b["round"], b["attempt"], int(shard), reason,
        )


async def _round_failed(tx: Any, b: dict[str, Any], ts: float) -> None:
    await tx.execute(
        "UPDATE round_views SET status = 'failed', reason = $4, ended_at = $5"
        " WHERE job_id = $1 AND round = $2 AND attempt = $3 AND status = 'running'",
        b["job_id"], b["round"], b["attempt"], b["reason"], ts,
    )


async def _job_completed(tx: Any, b: dict[str, Any], ts: float) -> None:
    await _ensure_job(tx, b["job_id"], ts)
    await tx.execute(
        "UPDATE job_views SET status = 'completed', round = $2, final_model = $3, metrics = $4, updated_at = $5"
        " WHERE job_id = $1",
        b["job_id"], b["rounds_completed"], b["final_model"], to_json(b.get("metrics", {})), ts,
    )


async def _job_waiting(tx: Any, b: dict[str, Any], ts: float) -> None:
    await _ensure_job(tx, b["job_id"], ts)
    await tx.execute(
        "UPDATE job_views SET status = 'waiting', reason = $2, updated_at = $3 WHERE job_id = $1",
        b["job_id"], b["reason"], ts,
    )


async def _job_failed(tx: Any, b: dict[str, Any], ts: float) -> None:
    await _ensure_job(tx, b["job_id"], ts)
    status = "cancelled" if b.get("cancelled") is True else "failed"
    await tx.execute(
        "UPDATE job_views SET status = $2, reason = $3, updated_at = $4 WHERE job_id = $1",
        b["job_id"], status, b["reason"], ts,
    )
    # The round it was in ends with it (a result that still comes in is recorded as it arrives).
    await tx.execute(
        "UPDATE round_views SET status = $2, reason = $3, ended_at = $4 WHERE job_id = $1 AND status = 'running'",
        b["job_id"], status, b["reason"], ts,
    )


async def _worker_online(tx: Any, b: dict[str, Any], ts: float) -> None:
    await _touch_worker(tx, b["worker_id"], ts, state="idle", hostname=b.get("hostname"), gpu=b.get("gpu"))


async def _worker_heartbeat(tx: Any, b: dict[str, Any], ts: float) -> None:
    if b.get("state") == "training" and isinstance(b.get("job_id"), str) and isinstance(b.get("shard"), int):
        # The worker took the shard but has not reported progress yet: it is training, not waiting.
        await tx.execute(
            "UPDATE shard_views SET state = 'training', worker_id = $4, updated_at = $5"
            " WHERE job_id = $1 AND round = $2 AND shard = $3 AND state = 'assigned'",
            b["job_id"], b.get("round"), b["shard"], b["worker_id"], ts,
        )
    await _touch_worker(tx, b["worker_id"], ts, state=b.get("state"), job_id=b.get("job_id"),
                        round_index=b.get("round"), shard=b.get("shard"), gpu=b.get("gpu"),
                        samples_per_s=b.get("samples_per_s"))


async def _worker_offline(tx: Any, b: dict[str, Any], ts: float) -> None:
    await _touch_worker(tx, b["worker_id"], ts, state="stopped")
    await tx.execute("UPDATE workers SET status = 'offline' WHERE worker_id = $1", b["worker_id"])


async def _touch_worker(tx: Any, worker_id: str, ts: float, *, state: str | None = None,
                        hostname: str | None = None, job_id: str | None = None, round_index: int | None = None,
                        shard: int | None = None, gpu: dict[str, Any] | None = None,
                        samples_per_s: float | None = None) -> None:
    await tx.execute(
        "INSERT INTO workers (worker_id, hostname, status, state, first_seen, last_seen)"
        " VALUES ($1, $2, 'online', $3, $4, $4) ON CONFLICT DO NOTHING",
        worker_id, hostname, state, ts,
    )
    await tx.execute(
        "UPDATE workers SET status = 'online', state = COALESCE($2, state), hostname = COALESCE($3, hostname),"
        " job_id = $4, round = $5, shard = $6, gpu = COALESCE($7, gpu),"
        " samples_per_s = COALESCE($8, samples_per_s), last_seen = $9 WHERE worker_id = $1",
        worker_id, state, hostname, job_id, round_index, shard, to_json(gpu) if gpu else None,
        float(samples_per_s) if samples_per_s is not None else None, ts,
    )


async def _ensure_job(tx: Any, job_id: str, ts: float) -> None:
    await tx.execute(
        "INSERT INTO job_views (job_id, status, created_at, updated_at) VALUES ($1, 'requested', $2, $2)"
        " ON CONFLICT DO NOTHING",
        job_id, ts,
    )


_VIEWS = {
    "job.requested": _job_requested,
    "job.accepted": _job_accepted,
    "job.rejected": _job_rejected,
    "round.start": _round_start,
    "worker.progress": _worker_progress,
    "worker.done": _worker_done,
    "worker.failed": _worker_failed,
    "round.aggregated": _round_aggregated,
    "round.failed": _round_failed,
    "job.completed": _job_completed,
    "job.failed": _job_failed,
    "job.waiting": _job_waiting,
    "worker.online": _worker_online,
    "worker.heartbeat": _worker_heartbeat,
    "worker.offline": _worker_offline,
}


__all__ = ["TERMINAL", "Tracker", "job_view"]
