"""The tracker's HTTP API (FastAPI): submit, follow and cancel jobs, see workers, stream live updates."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from apiary.bus.base import Unroutable
from apiary.bus.typed import publish_event
from apiary.contracts import JobCancelRequested, JobRequested
from apiary.jobspec import FieldError, describe_errors
from services.tracker import schemas
from services.tracker.publish import publish_job_request
from services.tracker.views import TERMINAL, job_metrics, job_view, list_jobs, workers_view

if TYPE_CHECKING:
    from services.tracker.service import Tracker

PREFIX = "/api/v1"
STATIC = Path(__file__).with_name("static")
# Live streams coalesce bursts of events into at most one update per interval.
MIN_INTERVAL = 0.25
KEEPALIVE = 15.0
# Concurrent tracker transactions can commit metric rows out of sequence order; a live stream
# re-reads this many sequence numbers behind its cursor so a late commit is still sent.
LOOKBACK = 512

NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": schemas.Problem, "description": "no such job"}}


def create_app(tracker: Tracker) -> FastAPI:
    """The API and the dashboard, reading the tracker's tables and publishing on its bus."""
    app = FastAPI(
        title="Apiary tracker",
        version="1",
        summary="Submit federated training jobs, follow them live, and see the workers.",
        # Swagger UI and ReDoc load their scripts from a CDN; machines running Apiary may be offline.
        docs_url=None,
        redoc_url=None,
    )
    app.add_exception_handler(RequestValidationError, _invalid_request)  # type: ignore[arg-type]
    db = tracker.db

    @app.post(f"{PREFIX}/training-jobs", status_code=202, response_model=schemas.JobSubmitted,
              responses={422: {"model": schemas.Problem, "description": "each bad field, named"},
                         409: {"model": schemas.Problem, "description": "the job id is taken"},
                         503: {"model": schemas.Problem, "description": "no scheduler is listening"}})
    async def submit_job(request: JobRequested) -> JSONResponse:
        """Publish a job request (`job.requested`); the job id is the request's, or a new one."""
        body = request.model_dump(mode="json", exclude_unset=True, exclude={"v"})
        if request.job_id is not None and await _status(request.job_id) is not None:
            raise HTTPException(409, f"job id {request.job_id!r} is already taken: choose another")
        try:
            job_id = await publish_job_request(tracker.bus, body)
        except (RuntimeError, Unroutable) as e:
            raise HTTPException(503, str(e)) from e
        # The row the job.requested event would create, so the job is visible before the event lands.
        await db.execute(
            "INSERT INTO job_views (job_id, name, status, num_rounds, created_at, updated_at)"
            " VALUES ($1, $2, 'requested', $3, $4, $4) ON CONFLICT DO NOTHING",
            job_id, request.name, request.distributed.num_rounds, time.time(),
        )
        url = f"{PREFIX}/training-jobs/{job_id}"
        content = schemas.JobSubmitted(job_id=job_id, status="requested", url=url, events_url=f"{url}/events")
        return JSONResponse(content.model_dump(), status_code=202, headers={"Location": url})

    @app.get(f"{PREFIX}/training-jobs", response_model=list[schemas.JobSummary])
    async def get_jobs(limit: int = Query(100, ge=1, le=1000)) -> list[dict[str, Any]]:
        """Jobs, newest first, each with its status and round."""
        return await list_jobs(db, limit)

    @app.get(f"{PREFIX}/training-jobs/{{job_id}}", response_model=schemas.JobDetail, responses=NOT_FOUND)
    async def get_job(job_id: str) -> dict[str, Any]:
        """A job's status, rounds, per-worker progress in the current round, failure reason, final model."""
        view = await job_view(db, job_id)
        if view is None:
            raise _no_job(job_id)
        return view

    @app.get(f"{PREFIX}/training-jobs/{{job_id}}/metrics", response_model=schemas.JobMetrics,
             responses=NOT_FOUND)
    async def get_metrics(job_id: str, name: str = Query("loss", description="which metric"),
                          after: int = Query(0, ge=0, description="only points after this cursor")
                          ) -> dict[str, Any]:
        """Per-worker curves and the aggregated value per round of one metric, ready to draw."""
        metrics = await job_metrics(db, job_id, name, after)
        if metrics is None:
            raise _no_job(job_id)
        return metrics

    @app.post(f"{PREFIX}/training-jobs/{{job_id}}/cancel", status_code=202,
              response_model=schemas.CancelRequested,
              responses={**NOT_FOUND, 409: {"model": schemas.Problem, "description": "the job already ended"},
                         503: {"model": schemas.Problem, "description": "no scheduler is listening"}})
    async def cancel_job(job_id: str) -> dict[str, Any]:
        """Ask the scheduler to stop a job; no further round starts."""
        status = await _status(job_id)
        if status is None:
            raise _no_job(job_id)
        if status in TERMINAL:
            raise HTTPException(409, f"job {job_id} already ended ({status}): there is nothing to cancel")
        try:
            await publish_event(tracker.bus, JobCancelRequested(job_id=job_id))
        except Unroutable as e:
            raise HTTPException(503, f"no scheduler is listening for job.cancel: {e}") from e
        return {"job_id": job_id, "status": "cancelling"}

    @app.get(f"{PREFIX}/workers", response_model=list[schemas.WorkerView])
    async def get_workers() -> list[dict[str, Any]]:
        """Every worker seen: online or offline, last heartbeat, assignment, GPU, throughput."""
        return await workers_view(db)

    @app.get(f"{PREFIX}/training-jobs/{{job_id}}/events", response_class=StreamingResponse,
             responses={**NOT_FOUND, 200: {"content": {"text/event-stream": {}},
                                           "description": "Server-Sent Events: `metrics` (new points), "
                                           "`job` (the job's detail), `workers`, and `end` once it ended"}})
    async def job_events(job_id: str, metric: str = "loss",
                         last_event_id: str | None = Header(None)) -> StreamingResponse:
        """Live updates of one job, pushed whenever the tracker records a change."""
        if await _status(job_id) is None:
            raise _no_job(job_id)
        after = int(last_event_id) if last_event_id and last_event_id.isdigit() else 0
        return _event_stream(_job_stream(tracker, job_id, metric, after))

    @app.get(f"{PREFIX}/stream", response_class=StreamingResponse,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "Server-Sent Events: `jobs` (the jobs list) and `workers`"}})
    async def stream() -> StreamingResponse:
        """Live updates of the jobs list and the workers."""
        return _event_stream(_overview_stream(tracker))

    @app.get("/", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    async def _status(job_id: str) -> str | None:
        value = await db.fetchval("SELECT status FROM job_views WHERE job_id = $1", job_id)
        return None if value is None else str(value)

    return app


def _no_job(job_id: str) -> HTTPException:
    return HTTPException(404, f"no job {job_id!r}: list jobs at {PREFIX}/training-jobs")


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with one entry per bad field, in the request's own terms (as the scheduler rejects it)."""
    errors = request_errors(exc.errors())
    problem = schemas.Problem(detail=f"request rejected: {describe_errors(errors)}", errors=errors)
    return JSONResponse(problem.model_dump(), status_code=422)


def request_errors(items: Sequence[Any]) -> list[FieldError]:
    """FastAPI's validation errors as FieldErrors: `distributed.num_rounds`, not `body.distributed...`."""
    out = []
    for item in items:
        loc = [str(part) for part in item.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        if item.get("type") == "extra_forbidden":
            message = "unknown field"
        if item.get("type") == "json_invalid":
            loc, message = [], f"body is not valid JSON ({item.get('ctx', {}).get('error', message)})"
        out.append(FieldError(field=".".join(loc) or "(request)", message=message))
    return out


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    # No proxy buffering: each event must reach the browser when it is sent.
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse(event: str, data: str, event_id: int | None = None) -> str:
    """One Server-Sent Event (data is one line of JSON)."""
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return f"{head}data: {data}\n\n"


async def changes(tracker: Tracker) -> AsyncIterator[bool]:
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

    async def read(self, tracker: Tracker) -> dict[str, Any] | None:
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


async def _job_stream(tracker: Tracker, job_id: str, metric: str, after: int) -> AsyncIterator[str]:
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
        workers = await workers_view(tracker.db)
        yield sse("workers", json.dumps([schemas.WorkerView.model_validate(w).model_dump() for w in workers]),
                  feed.cursor)
        if view["status"] in TERMINAL:
            yield sse("end", json.dumps({"job_id": job_id, "status": view["status"]}), feed.cursor)
            return


async def _overview_stream(tracker: Tracker) -> AsyncIterator[str]:
    last_jobs = ""
    async for fresh in changes(tracker):
        if not fresh:
            yield ": keepalive\n\n"
            continue
        jobs = json.dumps([schemas.JobSummary.model_validate(j).model_dump() for j in await list_jobs(tracker.db)])
        if jobs != last_jobs:
            last_jobs = jobs
            yield sse("jobs", jobs)
        workers = await workers_view(tracker.db)
        yield sse("workers", json.dumps([schemas.WorkerView.model_validate(w).model_dump() for w in workers]))


__all__ = ["MetricsFeed", "changes", "create_app", "request_errors", "sse"]
