"""The registries' HTTP routes: register a model or dataset (its file as the request body; the id comes from
the tracker's database) and list them, so the CLI works the same against a remote or an in-process tracker."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi import Path as InPath

from apiary.dataset import DatasetError
from apiary.db import Database
from apiary.jobspec import INT64_MAX
from apiary.registry import MODEL_SUFFIXES, RegistryError, Upload, store_dataset, store_model
from apiary.storage import Storage
from services.tracker import registry_store
from services.tracker.auth import principal_of
from services.tracker.registry_store import Kind
from services.tracker.schemas import CHANGES, PREFIX, Problem
from services.tracker.tables import LazyTables
from services.tracker.views import TERMINAL, jobs_using

log = logging.getLogger("apiary.tracker")
REJECTED: dict[int | str, dict[str, Any]] = {422: {"model": Problem, "description": "what is wrong with the file"}}
UNKNOWN: dict[int | str, dict[str, Any]] = {404: {"model": Problem, "description": "no such id"}}
SAFE_NAME = r"^[\w.\-]{1,200}$"


class RegistryTracker(Protocol):
    """What the registry routes need of the tracker: the id tables' database and the storage files go to."""

    @property
    def db(self) -> Database:
        """The tracker's database (the id tables)."""

    @property
    def storage(self) -> Storage:
        """Where registered files and their records live."""


class Registries:
    """Registrations against one tracker: ids from its database, files and records in its storage."""

    def __init__(self, tracker: RegistryTracker) -> None:
        self._tracker = tracker
        self._tables = LazyTables(tracker.db, registry_store.COMPONENT, registry_store.MIGRATIONS)

    async def ready(self) -> Database:
        """The database, its id tables created on first use (also by an in-process tracker never started)."""
        return await self._tables.ready()

    async def register(self, kind: Kind, request: Request, name: str, filename: str) -> dict[str, Any]:
        """Store the request's body under a new id; 422 with the reason if it is not a valid model or dataset."""
        with tempfile.TemporaryDirectory(prefix="apiary-register-") as tmp:
            file = Path(tmp) / filename
            with file.open("wb") as out:
                async for chunk in request.stream():
                    out.write(chunk)
            return await self.register_file(kind, file, name)

    async def register_file(self, kind: Kind, file: Path, name: str) -> dict[str, Any]:
        """Store a received file (named as the user's) under a new id; 422 with the reason if it is not a valid
        model or dataset, and then no id stays allocated."""
        db = await self.ready()
        async with db.transaction() as tx:
            item_id = await registry_store.allocate(tx, kind, name)
        try:
            info = await self._store(kind, item_id, file, name)
        except (RegistryError, DatasetError) as e:
            async with db.transaction() as tx:
                await registry_store.abandon(tx, kind, item_id)
            raise HTTPException(422, str(e)) from None
        async with db.transaction() as tx:
            await registry_store.complete(tx, kind, item_id, info)
        log.info("registered %s %d (%s, %d bytes)", kind[:-1], item_id, name, info["size"])
        return info

    async def _store(self, kind: Kind, item_id: int, file: Path, name: str) -> dict[str, Any]:
        storage = self._tracker.storage
        if kind == "datasets":
            return await store_dataset(storage, item_id, Upload(file, name))
        fmt = MODEL_SUFFIXES.get(file.suffix.lower())
        if fmt is None:
            raise RegistryError(f"model file {file.name}: expected a .zip (a model folder), .gguf or .safetensors")
        return await store_model(storage, item_id, Upload(file, name, fmt))

    @property
    def db(self) -> Database:
        """The tracker's database (its job views name the jobs that use a registered id)."""
        return self._tracker.db

    async def delete(self, kind: Kind, item_id: int) -> None:
        """Remove a registered id: its row first (no job can name it from then on), then its files."""
        async with (await self.ready()).transaction() as tx:
            await registry_store.remove(tx, kind, item_id)
        storage = self._tracker.storage
        for key in await storage.list(f"{kind}/{item_id}/"):
            await storage.delete(key)
        log.info("deleted %s %d", kind[:-1], item_id)

    async def known(self, kind: Kind, item_id: int) -> bool:
        """Whether an id names a registered model or dataset."""
        return await registry_store.one(await self.ready(), kind, item_id) is not None


def registry_routes(registries: Registries) -> APIRouter:
    """`POST /models`, `POST /datasets` (the file as the body) and `GET` of each list and item."""
    router = APIRouter()
    for kind in ("models", "datasets"):
        _kind_routes(router, registries, kind)
    return router


def _kind_routes(router: APIRouter, registries: Registries, kind: Kind) -> None:
    """The three routes of one registry."""
    what = kind[:-1]

    @router.post(f"/{kind}", status_code=201, responses={**REJECTED, **CHANGES}, name=f"register_{what}",
                 openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}})
    async def register(request: Request,
                       filename: str = Query(..., pattern=SAFE_NAME, description="the file's name (a .zip is a "
                                             "zipped folder)"),
                       name: str = Query(..., pattern=SAFE_NAME, description="a name for people")
                       ) -> dict[str, Any]:
        """Register the body (a zipped folder, or the file itself) under a new integer id."""
        return await registries.register(kind, request, name, filename)

    @router.get(f"/{kind}", name=f"list_{kind}")
    async def listed() -> list[dict[str, Any]]:
        """Every registered one, newest first."""
        return await registry_store.listed(await registries.ready(), kind)

    @router.get(f"/{kind}/{{item_id}}", responses=UNKNOWN, name=f"get_{what}")
    async def one(item_id: int = InPath(ge=1, le=INT64_MAX, description="its id")) -> dict[str, Any]:
        """One registered by id, with the jobs whose request names it (`used_by`: job_id, name, status)."""
        info = await registered(item_id)
        return {**info, "used_by": await jobs_using(registries.db, f"{what}_id", item_id)}

    @router.delete(f"/{kind}/{{item_id}}", status_code=204, name=f"delete_{what}",
                   responses={**UNKNOWN, **CHANGES, 409: {"model": Problem, "description": "a job still needs it"}})
    async def delete(http: Request, item_id: int = InPath(ge=1, le=INT64_MAX, description="its id")) -> Response:
        """Remove a registered one and its files (admin tokens only), unless a job that has not ended names it."""
        principal = principal_of(http)
        if not principal.may("admin"):
            raise HTTPException(403, f"token {principal.name!r} is a {principal.role} token: deleting a {what} "
                                     "needs an admin token")
        await registered(item_id)
        needing = [j for j in await jobs_using(registries.db, f"{what}_id", item_id) if j["status"] not in TERMINAL]
        if needing:
            first, more = needing[0], f" and {len(needing) - 1} more" if len(needing) > 1 else ""
            raise HTTPException(409, f"{what} {item_id} is needed by job {first['job_id']} ({first['status']}){more}: "
                                     "cancel them or wait until they end")
        await registries.delete(kind, item_id)
        return Response(status_code=204)

    async def registered(item_id: int) -> dict[str, Any]:
        info = await registry_store.one(await registries.ready(), kind, item_id)
        if info is None:
            raise HTTPException(404, f"no {what} {item_id}: list them at {PREFIX}/{kind}")
        return info
