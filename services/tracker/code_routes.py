"""Code bundles over the HTTP API: `POST /code` stores one (checked, content-addressed) for jobs to reference
as `code: {key, sha256}`; a submitted job's reference is checked the way the scheduler checks it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, Field

from apiary import bundle_store
from apiary.jobspec import FieldError, JobSpec
from apiary.storage import Storage
from services.tracker.registry_routes import RegistryTracker
from services.tracker.schemas import CHANGES, Problem

SHA256 = r"^[0-9a-f]{64}$"


class StoredCode(BaseModel):
    """A stored code bundle: what a job's `code` names."""

    key: str = Field(description="code/<sha256>.zip")
    sha256: str
    size: int = Field(description="the zip's bytes")


def code_routes(tracker: RegistryTracker) -> APIRouter:
    """`POST /code`: the body is a bundle (a zip, as `apiary submit` packs a folder)."""
    router = APIRouter()

    @router.post("/code", status_code=201, response_model=StoredCode,
                 responses={422: {"model": Problem, "description": "why the zip is no acceptable bundle"},
                            **CHANGES},
                 openapi_extra={"requestBody": {"content": {"application/zip": {}}, "required": True}})
    async def upload_code(request: Request, sha256: str | None = Query(
            None, pattern=SHA256, description="the sha256 the body must have")) -> dict[str, Any]:
        """Store a code bundle under code/<sha256>.zip (once: the same bytes are stored once)."""
        data = await request.body()  # no more than bundle.MAX_BUNDLE_BYTES (services.tracker.body_limit)
        try:
            stored = await bundle_store.store(tracker.storage, data, sha256)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        return stored.as_dict()

    return router


async def code_errors(storage: Storage, body: dict[str, Any]) -> list[FieldError]:
    """A submitted request's code bundle checked as the scheduler will (there, its sha256, its entrypoint's
    module inside); on success the body's `code` gains the bundle's size."""
    if not body.get("code"):
        return []
    spec = JobSpec.model_validate({k: v for k, v in body.items() if k not in ("job_id", "v")})
    errors, checked = await bundle_store.code_errors(storage, spec)
    if not errors and checked.code is not None:
        body["code"] = checked.code.model_dump()
    return errors


__all__ = ["StoredCode", "code_errors", "code_routes"]
