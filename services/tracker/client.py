"""Following a job through a tracker's HTTP API, from any machine that can reach it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from services.tracker.api import PREFIX


class JobNotFound(LookupError):
    """The tracker knows no job by that id."""


async def get_job(base_url: str, job_id: str) -> dict[str, Any]:
    """The job's detail (GET /api/v1/training-jobs/{id}); raises JobNotFound."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        response = await http.get(f"{PREFIX}/training-jobs/{job_id}")
        if response.status_code == 404:
            raise JobNotFound(response.json()["detail"])
        response.raise_for_status()
        return dict(response.json())


async def watch_job(base_url: str, job_id: str) -> AsyncIterator[dict[str, Any]]:
    """Each new view of the job, pushed by the tracker, up to the one in which it ended; raises
    JobNotFound, or httpx.HTTPError if the connection fails."""
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(30, read=None)) as http,
        http.stream("GET", f"{PREFIX}/training-jobs/{job_id}/events") as response,
    ):
        if response.status_code == 404:
            await response.aread()
            raise JobNotFound(response.json()["detail"])
        response.raise_for_status()
        async for event, data in _events(response):
            if event == "job":
                yield json.loads(data)
            elif event == "end":
                return


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


__all__ = ["JobNotFound", "get_job", "watch_job"]
