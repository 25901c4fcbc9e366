"""The tracker's HTTP API (FastAPI): submit, follow and cancel jobs, see workers, stream live updates."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from apiary import bundle, metrics
from apiary.bus import Bus
from apiary.bus.base import Unroutable
from apiary.bus.typed import publish_event
from apiary.contracts import JobCancelRequested, JobRequested
from apiary.jobspec import INT64_MAX, FieldError, cross_field_errors, describe_errors, policy_errors, unknown_field
from apiary.policy import Policy
from apiary.settings import Settings
from services.tracker import schemas, token_store
from services.tracker.auth import Tokens, guard, may_cancel, principal_of
from services.tracker.body_limit import BodyLimit, Limit, LimitOf
from services.tracker.code_routes import code_errors, code_routes
from services.tracker.form_routes import form_routes
from services.tracker.publish import publish_job_request
from services.tracker.registry_routes import Registries, RegistryTracker, registry_routes
from services.tracker.registry_store import Kind
from services.tracker.schemas import API_ERRORS, CHANGES, JOB_ID, NOT_FOUND, PREFIX, UNPARSED, no_job
from services.tracker.stream import LiveTracker, stream_routes
from services.tracker.upload_routes import MAX_CHUNK_BYTES, Uploads, upload_routes
from services.tracker.views import (
    TERMINAL,
    job_metrics,
    job_status,
    job_view,
    list_jobs,
    record_requested,
    workers_view,
)

STATIC = Path(__file__).with_name("static")
NO_SCHEDULER: dict[int | str, dict[str, Any]] = {
    503: {"model": schemas.Problem, "description": "no scheduler is listening"}}


class ApiTracker(LiveTracker, RegistryTracker, Protocol):
    """What the API needs of the tracker: what its live streams read, its storage (the registries), and the
    bus it publishes on."""

    @property
    def bus(self) -> Bus:
        """The bus that job requests and cancels are published on."""

    @property
    def settings(self) -> Settings:
        """Its settings: what the operator's policy allows a job request (apiary.policy)."""


def create_app(tracker: ApiTracker) -> FastAPI:
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
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_middleware(BodyLimit, limit_of=body_limits(tracker.settings))
    registries = Registries(tracker)
    tokens = Tokens(tracker.db)
    # Every API route needs a token (see services.tracker.auth); the live streams also take it as ?token=.
    authorised, streaming = [Depends(guard(tokens))], [Depends(guard(tokens, query=True))]
    uploads = Uploads(tracker.settings.home / "uploads", registries)
    for router in (_job_commands(tracker, registries, tokens), _job_reads(tracker), _worker_routes(tracker),
                   registry_routes(registries), upload_routes(uploads), code_routes(tracker),
                   form_routes(tracker)):
        app.include_router(router, prefix=PREFIX, dependencies=authorised, responses=API_ERRORS)
    app.include_router(stream_routes(tracker), prefix=PREFIX, dependencies=streaming, responses=API_ERRORS)
    app.include_router(_dashboard_routes())
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def body_limits(settings: Settings) -> LimitOf:
    """Each route's body limit: a code bundle's own, none for a registered file (streamed to disk as it comes),
    APIARY_HTTP_BODY_LIMIT for everything else."""

    def limit_of(method: str, path: str) -> Limit | None:
        if method == "POST" and path == f"{PREFIX}/code":
            return Limit(bundle.MAX_BUNDLE_BYTES, f"leave data and checkpoints out with {bundle.IGNORE_FILE}")
        if method == "POST" and path in (f"{PREFIX}/models", f"{PREFIX}/datasets"):
            return None
        if method == "PUT" and path.startswith(f"{PREFIX}/uploads/"):
            return Limit(MAX_CHUNK_BYTES, "send a file in chunks of the upload's chunk_size")
        return Limit(settings.http_body_limit, "send less, or ask the operator to raise APIARY_HTTP_BODY_LIMIT")

    return limit_of


def _job_commands(tracker: ApiTracker, registries: Registries, tokens: Tokens) -> APIRouter:
    """Submitting and cancelling jobs: both publish on the tracker's bus; a job records whose token submitted
    it, and a submitter may cancel only its own."""
    router = APIRouter()

    @router.post("/training-jobs", status_code=202, response_model=schemas.JobSubmitted,
                 responses={200: {"model": schemas.JobChecked, "description": "dry_run: the request would be "
                                  "accepted; nothing was submitted"},
                            422: {"model": schemas.Problem, "description": "each bad field, named"},
                            409: {"model": schemas.Problem, "description": "the job id is taken"}, **NO_SCHEDULER,
                            **CHANGES, **UNPARSED})
    async def submit_job(request: JobRequested, http: Request, dry_run: bool = Query(
            False, description="only check the request as a submission would (every bad field named, 422), "
                               "and submit nothing")) -> JSONResponse:
        """Publish a job request (`job.requested`); the job id is the request's, or a new one."""
        body = request.model_dump(mode="json", exclude_unset=True, exclude={"v"})
        unknown = (policy_errors(request, Policy.of(tracker.settings)) or await _unregistered(registries, request)
                   or await code_errors(tracker.storage, body))
        if unknown:
            problem = schemas.Problem(detail=f"request rejected: {describe_errors(unknown)}", errors=unknown)
            return JSONResponse(problem.model_dump(), status_code=422)
        if request.job_id is not None and await job_status(tracker.db, request.job_id) is not None:
            raise HTTPException(409, f"job id {request.job_id!r} is already taken: choose another")
        if dry_run:
            return JSONResponse(schemas.JobChecked(request=body).model_dump(), status_code=200)
        try:
            job_id = await publish_job_request(tracker.bus, body)
        except (RuntimeError, Unroutable) as e:
            raise HTTPException(503, str(e)) from e
        await record_requested(tracker.db, job_id, request.name, request.distributed.num_rounds)
        await token_store.record_submitter(await tokens.ready(), job_id, principal_of(http).name)
        url = f"{PREFIX}/training-jobs/{job_id}"
        content = schemas.JobSubmitted(job_id=job_id, status="requested", url=url, events_url=f"{url}/events")
        return JSONResponse(content.model_dump(), status_code=202, headers={"Location": url})

    @router.post("/training-jobs/{job_id}/cancel", status_code=202, response_model=schemas.CancelRequested,
                 responses={**NOT_FOUND, 409: {"model": schemas.Problem, "description": "the job already ended"},
                            **NO_SCHEDULER, **CHANGES, **UNPARSED})
    async def cancel_job(http: Request, job_id: str = JOB_ID, body: schemas.CancelJob | None = None,
                         ahead: bool = Query(False, description="cancel also a job not known yet: if its request "
                                             "comes, it will not start")) -> dict[str, Any]:
        """Ask the scheduler to stop a job; no further round starts."""
        status = await job_status(tracker.db, job_id)
        if status is None and not ahead:
            raise no_job(job_id)
        await may_cancel(tokens, principal_of(http), job_id, known=status is not None)
        if status in TERMINAL:
            raise HTTPException(409, f"job {job_id} already ended ({status}): there is nothing to cancel")
        try:
            await publish_event(tracker.bus, JobCancelRequested(job_id=job_id, **(body.model_dump() if body else {})))
        except Unroutable as e:
            raise HTTPException(503, f"no scheduler is listening for job.cancel: {e}") from e
        return {"job_id": job_id, "status": "cancelling" if status is not None else "unknown"}

    return router


async def _unregistered(registries: Registries, request: JobRequested) -> list[FieldError]:
    """One error per integer model_id or dataset_id that no registration has (older hex ids are the
    sharder's to check)."""
    named: list[tuple[Kind, int | str | None]] = [("models", request.model_id), ("datasets", request.dataset_id)]
    return [FieldError(field=f"{kind[:-1]}_id", message=f"{kind[:-1]} {item_id} is unknown: list them at "
                         f"{PREFIX}/{kind}")
              for kind, item_id in named
              if isinstance(item_id, int) and not await registries.known(kind, item_id)]


def _job_reads(tracker: ApiTracker) -> APIRouter:
    """The jobs list, one job's detail and its metrics as chart series."""
    router = APIRouter()

    @router.get("/training-jobs", response_model=list[schemas.JobSummary])
    async def get_jobs(limit: int = Query(100, ge=1, le=1000, description="at most this many jobs")
                       ) -> list[dict[str, Any]]:
        """Jobs, newest first, each with its status and round."""
        return await list_jobs(tracker.db, limit)

    @router.get("/training-jobs/{job_id}", response_model=schemas.JobDetail, responses=NOT_FOUND)
    async def get_job(job_id: str = JOB_ID) -> dict[str, Any]:
        """A job's status, rounds, per-worker progress in the current round, failure reason, final model."""
        view = await job_view(tracker.db, job_id)
        if view is None:
            raise no_job(job_id)
        return view

    @router.get("/training-jobs/{job_id}/metrics", response_model=schemas.JobMetrics, responses=NOT_FOUND)
    async def get_metrics(job_id: str = JOB_ID,
                          name: str = Query("loss", min_length=1, max_length=200, description="which metric"),
                          after: int = Query(0, ge=0, le=INT64_MAX, description="only points after this cursor")
                          ) -> dict[str, Any]:
        """Per-worker curves and the aggregated value per round of one metric, ready to draw."""
        metrics = await job_metrics(tracker.db, job_id, name, after)
        if metrics is None:
            raise no_job(job_id)
        return metrics

    return router


def _worker_routes(tracker: ApiTracker) -> APIRouter:
    """The workers the tracker has seen."""
    router = APIRouter()

    @router.get("/workers", response_model=list[schemas.WorkerView])
    async def get_workers() -> list[dict[str, Any]]:
        """Every worker seen: online or offline, last heartbeat, assignment, GPU, throughput."""
        return await workers_view(tracker.db)

    return router


def _dashboard_routes() -> APIRouter:
    """The dashboard's page (its scripts and styles are mounted under /static), and the process's metrics for
    Prometheus (no token, as a probe: what it shows has no job's data; 404 unless APIARY_METRICS=prometheus)."""
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        try:
            body, content_type = metrics.exposition()
        except LookupError as e:
            raise HTTPException(404, str(e)) from e
        return Response(body, media_type=content_type)

    return router


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with one entry per bad field, in the request's own terms (as the scheduler rejects it), all at once:
    also the rules across fields that pydantic skipped because a field of their block was bad."""
    errors = request_errors(exc.errors())
    if request.url.path == f"{PREFIX}/training-jobs":
        seen = {(e.field, e.message) for e in errors}
        errors += [e for e in cross_field_errors(exc.body) if (e.field, e.message) not in seen]
    problem = schemas.Problem(detail=f"request rejected: {describe_errors(errors)}", errors=errors)
    return JSONResponse(problem.model_dump(), status_code=422)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """An HTTPException as FastAPI answers it; a body FastAPI could not parse also says why."""
    if exc.status_code == 400 and exc.__cause__ is not None:
        detail = f"the body could not be parsed: {type(exc.__cause__).__name__}: {exc.__cause__}"
        return JSONResponse(schemas.Problem(detail=detail).model_dump(), status_code=400)
    return await http_exception_handler(request, exc)


def request_errors(items: Sequence[Any]) -> list[FieldError]:
    """FastAPI's validation errors as FieldErrors: `distributed.num_rounds`, not `body.distributed...`; an unknown
    field of a job request names the known one it is closest to."""
    out = []
    for item in items:
        loc = [str(part) for part in item.get("loc", ())]
        in_body = bool(loc) and loc[0] == "body"
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        if item.get("type") == "extra_forbidden":
            message = unknown_field(tuple(loc)) if in_body else "unknown field"
        if item.get("type") == "json_invalid":
            loc, message = [], f"body is not valid JSON ({item.get('ctx', {}).get('error', message)})"
        out.append(FieldError(field=".".join(loc) or "(request)", message=message))
    return out


__all__ = ["PREFIX", "ApiTracker", "create_app", "request_errors"]
