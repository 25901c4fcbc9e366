"""The one client of the tracker's HTTP API (REST and Server-Sent Events), over the network or in-process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from services.tracker.api_path import PREFIX

# How often a follower asks again for a job the tracker has not recorded yet (its request is on the bus).
UNKNOWN_JOB_RETRY = 0.25


class TrackerError(RuntimeError):
    """The tracker refused a request; the message is its one-line reason."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(detail)
        self.status_code = status_code


class JobNotFound(LookupError):
    """The tracker knows no job by that id."""


class TrackerClient:
    """Submit, follow and cancel jobs and list workers through a tracker's HTTP API.

    `base_url` names a tracker over the network; `transport` (an ASGI transport over the tracker's app)
    serves the same API inside this process. `token` (from `apiary token create`) is sent as a bearer token.
    """

    def __init__(self, base_url: str = "http://tracker", *, transport: httpx.AsyncBaseTransport | None = None,
                 timeout: float = 30.0, token: str | None = None) -> None:
        self.base_url = base_url
        self._timeout = timeout
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._http = httpx.AsyncClient(base_url=base_url, transport=transport, timeout=timeout, headers=headers)

    async def __aenter__(self) -> TrackerClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections."""
        await self._http.aclose()

    async def submit_job(self, request: dict[str, Any]) -> dict[str, Any]:
        """Submit a job request (POST /training-jobs): its id, status and where to follow it."""
        return dict(await self._call("POST", "/training-jobs", json=request))

    async def list_jobs(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest jobs first, each with its status and round."""
        return list(await self._call("GET", "/training-jobs", params={"limit": limit}))

    async def get_job(self, job_id: str) -> dict[str, Any]:
        """The job's detail (GET /training-jobs/{id}); raises JobNotFound."""
        return dict(await self._call("GET", f"/training-jobs/{job_id}"))

    async def get_metrics(self, job_id: str, name: str = "loss", after: int = 0) -> dict[str, Any]:
        """One metric of a job as chart series, only points after the cursor `after`."""
        return dict(await self._call("GET", f"/training-jobs/{job_id}/metrics", params={"name": name, "after": after}))

    async def cancel_job(self, job_id: str, reason: str | None = None, *, ahead: bool = False) -> dict[str, Any]:
        """Ask the scheduler to stop a job: status `cancelling`, or `unknown` when (with `ahead`) no such job
        is known yet; raises JobNotFound, or TrackerError (409) when the job already ended."""
        body = {"reason": reason} if reason is not None else None
        return dict(await self._call("POST", f"/training-jobs/{job_id}/cancel", json=body,
                                     params={"ahead": "true"} if ahead else None))

    async def answers(self) -> bool:
        """Whether a tracker answers at this address (False: nothing listens, or not a tracker); one that
        refuses this client's token answers too."""
        try:
            response = await self._http.get(f"{PREFIX}/training-jobs", params={"limit": 1})
        except httpx.TransportError:
            return False
        return response.status_code in (200, 401, 403)

    async def workers(self) -> list[dict[str, Any]]:
        """Every worker the tracker has seen."""
        return list(await self._call("GET", "/workers"))

    async def watch_job(self, job_id: str, *, wait_known: bool = False) -> AsyncGenerator[dict[str, Any]]:
        """Each new view of the job, pushed by the tracker, up to the one in which it ended; raises
        JobNotFound (unless `wait_known`: then it waits for the job to be recorded), or httpx.HTTPError."""
        while True:
            try:
                async with aclosing(self._job_events(job_id)) as views:
                    async for view in views:
                        yield view
                return
            except JobNotFound:
                if not wait_known:
                    raise
            await asyncio.sleep(UNKNOWN_JOB_RETRY)

    async def _job_events(self, job_id: str) -> AsyncGenerator[dict[str, Any]]:
        # An event stream is quiet between changes (keepalives come every 15 s): no read timeout.
        async with self._http.stream("GET", f"{PREFIX}/training-jobs/{job_id}/events",
                                     timeout=httpx.Timeout(self._timeout, read=None)) as response:
            if response.is_error:
                await response.aread()
                _raise_for(response)
            async for event, data in _events(response):
                if event == "job":
                    yield json.loads(data)
                elif event == "end":
                    return

    async def register(self, kind: str, file: Path, name: str) -> dict[str, Any]:
        """Register a model or dataset file (`kind`: models or datasets; POST /{kind}): its record, with its id."""
        return dict(await self._call("POST", f"/{kind}", params={"name": name, "filename": file.name},
                                     content=_chunks(file), timeout=None,
                                     headers={"content-type": "application/octet-stream",
                                              "content-length": str(file.stat().st_size)}))

    async def upload_code(self, data: bytes, sha256: str | None = None) -> dict[str, Any]:
        """Store a code bundle (POST /code): its reference for a job's `code` ({key, sha256, size})."""
        return dict(await self._call("POST", "/code", params={"sha256": sha256} if sha256 else None, content=data,
                                     headers={"content-type": "application/zip"}, timeout=None))

    async def registered(self, kind: str) -> list[dict[str, Any]]:
        """Every registered model or dataset (`kind`), newest first."""
        return list(await self._call("GET", f"/{kind}"))

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self._http.request(method, f"{PREFIX}{path}", **kwargs)
        if response.is_error:
            _raise_for(response)
        return response.json()


def _raise_for(response: httpx.Response) -> None:
    try:
        detail = str(response.json()["detail"])
    except (ValueError, KeyError, TypeError):
        detail = f"the tracker answered {response.status_code} {response.reason_phrase}"
    if response.status_code == 404:
        raise JobNotFound(detail)
    raise TrackerError(response.status_code, detail)


UPLOAD_CHUNK = 1 << 20  # bytes read at a time from a file being registered: a model is never held whole


async def _chunks(file: Path) -> AsyncIterator[bytes]:
    """The file's bytes, a chunk at a time, read off the event loop."""
    with file.open("rb") as f:
        while chunk := await asyncio.to_thread(f.read, UPLOAD_CHUNK):
            yield chunk


async def _events(response: httpx.Response) -> AsyncIterator[tuple[str, str]]:
    """Server-Sent Events as (event name, data) pairs."""
    event, data = "message", list[str]()
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", list[str]()
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


async def get_job(base_url: str, job_id: str, token: str | None = None) -> dict[str, Any]:
    """The job's detail from the tracker at `base_url`; raises JobNotFound."""
    async with TrackerClient(base_url, token=token) as client:
        return await client.get_job(job_id)


async def watch_job(base_url: str, job_id: str, token: str | None = None) -> AsyncGenerator[dict[str, Any]]:
    """Each new view of the job from the tracker at `base_url`, up to the one in which it ended."""
    async with TrackerClient(base_url, token=token) as client, aclosing(client.watch_job(job_id)) as views:
        async for view in views:
            yield view


__all__ = ["JobNotFound", "TrackerClient", "TrackerError", "get_job", "watch_job"]
