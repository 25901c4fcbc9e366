"""The tracker's live updates as Server-Sent Events: one job's stream and the overview stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import APIRouter, Header, Query
from fastapi.responses import StreamingResponse

from apiary.db import Database
from apiary.jobspec import INT64_MAX
from services.tracker import schemas
from services.tracker.views import TERMINAL, job_metrics, job_status, job_view, list_jobs, workers_view

# Live streams coalesce bursts of events into at most one update per interval.
MIN_INTERVAL = 0.25
KEEPALIVE = 15.0
# Concurrent tracker transactions can commit metric rows out of sequence order; a live stream
# re-reads this many sequence numbers behind its cursor so a late commit is still sent.
LOOKBACK = 512


class LiveTracker(Protocol):
    """What the live streams read of the tracker: its tables, and the signal that they changed."""

    @property
    def db(self) -> Database:
        """The tracker's database (its views)."""

    @property
    def changed(self) -> asyncio.Condition:
        """Notified after each change the tracker records."""

    @property
    def version(self) -> int:
        """Bumped with every notification, so a waiter can tell whether it missed one."""

    @property
    def closing(self) -> asyncio.Event:
        """Set when the tracker stops: live streams end."""


def stream_routes(tracker: LiveTracker) -> APIRouter:
    """`GET /training-jobs/{id}/events` (one job, live) and `GET /stream` (jobs list and workers, live)."""
    router = APIRouter()

    @router.get("/training-jobs/{job_id}/events", response_class=StreamingResponse,
                responses={**schemas.NOT_FOUND, 200: {"content": {"text/event-stream": {}},
                                                      "description": "Server-Sent Events: `metrics` (new points), "
                                                      "`job` (the job's detail), `workers`, and `end` once it ended"}})
    async def job_events(job_id: str = schemas.JOB_ID,
                         metric: str = Query("loss", min_length=1, max_length=200, description="which metric"),
                         last_event_id: str | None = Header(
                             None, description="resume after this event id (as EventSource sends it)")
                         ) -> StreamingResponse:
        """Live updates of one job, pushed whenever the tracker records a change."""
        if await job_status(tracker.db, job_id) is None:
            raise schemas.no_job(job_id)
        after = _cursor(last_event_id)
        return _event_stream(_job_stream(tracker, job_id, metric, after))

    @router.get("/stream", response_class=StreamingResponse,
                responses={200: {"content": {"text/event-stream": {}},
                                 "description": "Server-Sent Events: `jobs` (the jobs list) and `workers`"}})
    async def stream() -> StreamingResponse:
        """Live updates of the jobs list and the workers."""
        return _event_stream(_overview_stream(tracker))

    return router


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    # No proxy buffering: each event must reach the browser when it is sent.
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse(event: str, data: str, event_id: int | None = None) -> str:
    """One Server-Sent Event (data is one line of JSON)."""
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return f"{head}data: {data}\n\n"


def _cursor(last_event_id: str | None) -> int:
    """Where a reconnecting stream resumes: the Last-Event-ID its browser sent, if it is one we sent (a cursor
    within int64), else the start."""
    if last_event_id and last_event_id.isascii() and last_event_id.isdigit() and int(last_event_id) <= INT64_MAX:
        return int(last_event_id)
    return 0


async def changes(tracker: LiveTracker) -> AsyncIterator[bool]:
    """True at once and after each change the tracker records (bursts coalesced), False as a keepalive
    when nothing changed for a while; ends when the tracker stops. Waits on `tracker.changed`."""
    seen = -1
    while not tracker.closing.is_set():
        if tracker.version != seen:
            seen = tracker.version
            yield True
            await asyncio.sleep(MIN_INTERVAL)
            continue
        def moved(last: int = seen) -> bool:
            return tracker.version != last or tracker.closing.is_set()

        async with tracker.changed:
            try:
                await asyncio.wait_for(tracker.changed.wait_for(moved), KEEPALIVE)
            except TimeoutError:
                pass
            else:
                continue
        yield False


class MetricsFeed:
    """The metric points one live stream has not sent yet."""

    def __init__(self, job_id: str, name: str, after: int) -> None:
        self.job_id, self.name = job_id, name
        self.floor = self.cursor = after
        self.sent: set[int] = set()

    async def read(self, tracker: LiveTracker) -> dict[str, Any] | None:
        """The job's metrics with only unsent points (None if the job is unknown)."""
        data = await job_metrics(tracker.db, self.job_id, self.name, max(self.floor, self.cursor - LOOKBACK))
        if data is None:
            return None
        for series in data["workers"]:
            series["points"] = [p for p in series["points"] if p["seq"] not in self.sent]
            self.sent.update(p["seq"] for p in series["points"])
        data["workers"] = [s for s in data["workers"] if s["points"]]
        self.cursor = max(self.cursor, data["cursor"])
        self.sent = {seq for seq in self.sent if seq > self.cursor - LOOKBACK}
        data["cursor"] = self.cursor
        return data


async def _workers_json(tracker: LiveTracker) -> str:
    return json.dumps([schemas.WorkerView.model_validate(w).model_dump() for w in await workers_view(tracker.db)])


async def _job_stream(tracker: LiveTracker, job_id: str, metric: str, after: int) -> AsyncIterator[str]:
    feed = MetricsFeed(job_id, metric, after)
    last_job = last_rounds = ""
    async for fresh in changes(tracker):
        if not fresh:
            yield ": keepalive\n\n"
            continue
        view = await job_view(tracker.db, job_id)
        metrics = await feed.read(tracker)
        if view is None or metrics is None:
            return
        rounds = json.dumps(metrics["rounds"])
        if metrics["workers"] or rounds != last_rounds:
            last_rounds = rounds
            yield sse("metrics", schemas.dump(schemas.JobMetrics, metrics), feed.cursor)
        job = schemas.dump(schemas.JobDetail, view)
        if job != last_job:
            last_job = job
            yield sse("job", job, feed.cursor)
        yield sse("workers", await _workers_json(tracker), feed.cursor)
        if view["status"] in TERMINAL:
            yield sse("end", json.dumps({"job_id": job_id, "status": view["status"]}), feed.cursor)
            return


async def _overview_stream(tracker: LiveTracker) -> AsyncIterator[str]:
    last_jobs = ""
    async for fresh in changes(tracker):
        if not fresh:
            yield ": keepalive\n\n"
            continue
        jobs = json.dumps([schemas.JobSummary.model_validate(j).model_dump() for j in await list_jobs(tracker.db)])
        if jobs != last_jobs:
            last_jobs = jobs
            yield sse("jobs", jobs)
        yield sse("workers", await _workers_json(tracker))


__all__ = ["LiveTracker", "MetricsFeed", "changes", "sse", "stream_routes"]
