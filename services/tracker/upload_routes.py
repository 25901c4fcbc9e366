"""Resumable uploads of models and datasets over the HTTP API: a file of several GB goes up in chunks, each
appended at the offset the tracker has received so far. A cut-off chunk leaves what arrived; the client asks how
much that is and goes on from there. Only a completed upload is registered (its id is allocated then), so a cut
or a refused file leaves no half-registered entry."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi import Path as InPath
from pydantic import BaseModel, Field

from apiary.jobspec import INT64_MAX
from services.tracker.auth import principal_of
from services.tracker.registry_routes import SAFE_NAME, Registries
from services.tracker.schemas import CHANGES, PREFIX, UNPARSED, Problem

CHUNK_BYTES = 8 * 2**20  # what a client sends per request
MAX_CHUNK_BYTES = 16 * 2**20  # the chunk route's body limit (services.tracker.api.body_limits)
UPLOAD_ID = InPath(pattern=r"^[0-9a-f]{32}$", description="the upload's id, as POST /uploads answered")
UNKNOWN: dict[int | str, dict[str, Any]] = {404: {"model": Problem, "description": "no such upload"}}


class NewUpload(BaseModel):
    """A file to upload in chunks, and what it is to be registered as."""

    kind: Literal["models", "datasets"]
    filename: str = Field(pattern=SAFE_NAME, description="the file's name; its suffix says its format")
    name: str = Field(pattern=SAFE_NAME, description="the name to register it under")
    size: int = Field(ge=0, le=INT64_MAX, description="the file's bytes")


class UploadState(NewUpload):
    """An upload under way: send the next chunk at `received`."""

    upload_id: str
    received: int = Field(description="bytes the tracker holds so far: the next chunk's offset")
    chunk_size: int = Field(description="bytes to send per chunk")


class Uploads:
    """Uploads under way, each a folder under `root` (its data so far and what it is), so a restarted tracker
    still resumes them."""

    def __init__(self, root: Path, registries: Registries) -> None:
        self.root, self.registries = root, registries
        self._locks: dict[str, asyncio.Lock] = {}

    def start(self, upload: NewUpload, owner: str) -> UploadState:
        """A new, empty upload."""
        upload_id = uuid.uuid4().hex
        folder = self.root / upload_id
        folder.mkdir(parents=True)
        (folder / "data").touch()
        (folder / "upload.json").write_text(json.dumps({**upload.model_dump(), "owner": owner}))
        return self.state(upload_id, owner)

    def state(self, upload_id: str, who: str | None) -> UploadState:
        """How far an upload is; 404 if there is none (or it is someone else's: `who` None is an admin)."""
        meta_file = self.root / upload_id / "upload.json"
        if not meta_file.is_file():
            raise HTTPException(404, f"no upload {upload_id}: it completed, was abandoned, or never began; start "
                                     f"one with POST {PREFIX}/uploads")
        meta = json.loads(meta_file.read_text())
        if who is not None and meta.pop("owner") != who:
            raise HTTPException(404, f"no upload {upload_id} of token {who!r}")
        meta.pop("owner", None)
        received = (self.root / upload_id / "data").stat().st_size
        return UploadState(**meta, upload_id=upload_id, received=received, chunk_size=CHUNK_BYTES)

    async def append(self, upload_id: str, who: str | None, offset: int, request: Request) -> UploadState:
        """Append the request's body at `offset`, which must be what the tracker holds so far (409 else)."""
        async with self._locks.setdefault(upload_id, asyncio.Lock()):
            state = self.state(upload_id, who)
            if offset != state.received:
                raise HTTPException(409, f"upload {upload_id} holds {state.received} bytes: send the chunk at offset "
                                         f"{state.received}, not {offset}")
            with (self.root / upload_id / "data").open("ab") as out:
                async for chunk in request.stream():
                    if out.tell() + len(chunk) > state.size:
                        raise HTTPException(413, f"upload {upload_id} would pass its declared size of {state.size} "
                                                 "bytes: start a new upload with the file's size")
                    out.write(chunk)
            return self.state(upload_id, who)

    async def complete(self, upload_id: str, who: str | None) -> dict[str, Any]:
        """Register the received file; the upload is gone afterwards, registered or refused (422, with why)."""
        async with self._locks.setdefault(upload_id, asyncio.Lock()):
            state = self.state(upload_id, who)
            if state.received != state.size:
                raise HTTPException(409, f"upload {upload_id} holds {state.received} of {state.size} bytes: send "
                                         f"the rest from offset {state.received} first")
            folder = self.root / upload_id
            file = folder / "data"
            named = file.rename(folder / state.filename)
            try:
                return await self.registries.register_file(state.kind, named, state.name)
            finally:
                self.abandon(upload_id)

    def abandon(self, upload_id: str) -> None:
        """Forget an upload and what it received."""
        shutil.rmtree(self.root / upload_id, ignore_errors=True)
        self._locks.pop(upload_id, None)


def upload_routes(uploads: Uploads) -> APIRouter:
    """`POST /uploads`, `GET`/`PUT`/`DELETE /uploads/{id}` and `POST /uploads/{id}/complete`."""
    router = APIRouter()

    def owner(http: Request) -> str | None:
        principal = principal_of(http)
        return None if principal.may("admin") else principal.name

    @router.post("/uploads", status_code=201, response_model=UploadState, responses={**CHANGES, **UNPARSED})
    async def start_upload(upload: NewUpload, http: Request) -> UploadState:
        """Begin a resumable upload of a model or dataset file: then PUT its chunks, then complete it."""
        return uploads.start(upload, principal_of(http).name)

    @router.get("/uploads/{upload_id}", response_model=UploadState, responses=UNKNOWN)
    async def get_upload(http: Request, upload_id: str = UPLOAD_ID) -> UploadState:
        """How many bytes an upload holds: where a cut-off upload resumes."""
        return uploads.state(upload_id, owner(http))

    @router.put("/uploads/{upload_id}", response_model=UploadState,
                responses={**UNKNOWN, **CHANGES, 409: {"model": Problem, "description": "the offset is not what the "
                                                       "upload holds: resume from `received`"}},
                openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}})
    async def put_chunk(http: Request, upload_id: str = UPLOAD_ID, offset: int = Query(
            ..., ge=0, le=INT64_MAX, description="where the chunk goes: the bytes the upload holds")) -> UploadState:
        """Append one chunk (the body, at most chunk_size bytes) at `offset`."""
        return await uploads.append(upload_id, owner(http), offset, http)

    @router.post("/uploads/{upload_id}/complete", status_code=201,
                 responses={**UNKNOWN, **CHANGES, 409: {"model": Problem, "description": "bytes are missing"},
                            422: {"model": Problem, "description": "what is wrong with the file"}})
    async def complete_upload(http: Request, upload_id: str = UPLOAD_ID) -> dict[str, Any]:
        """Register the uploaded file as a model or dataset under a new id (as POST /models or /datasets does)."""
        return await uploads.complete(upload_id, owner(http))

    @router.delete("/uploads/{upload_id}", status_code=204, responses={**UNKNOWN, **CHANGES})
    async def abandon_upload(http: Request, upload_id: str = UPLOAD_ID) -> Response:
        """Give an upload up: what it received is removed."""
        uploads.state(upload_id, owner(http))
        uploads.abandon(upload_id)
        return Response(status_code=204)

    return router


__all__ = ["CHUNK_BYTES", "MAX_CHUNK_BYTES", "NewUpload", "UploadState", "Uploads", "upload_routes"]
