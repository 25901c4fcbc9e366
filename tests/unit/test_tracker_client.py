"""The tracker's client over a mock transport, and the in-process transport that streams an ASGI app."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from services.tracker.client import JobNotFound, TrackerClient, TrackerError
from services.tracker.inprocess import StreamingASGITransport


def _tracker(status: int, body: dict[str, Any]) -> TrackerClient:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body)

    return TrackerClient("http://tracker", transport=httpx.MockTransport(answer))


async def test_an_unknown_job_is_job_not_found_with_the_trackers_reason() -> None:
    client = _tracker(404, {"detail": "no job 'x': list jobs at /api/v1/training-jobs"})

    with pytest.raises(JobNotFound, match="no job 'x'"):
        await client.get_job("x")


async def test_a_refusal_keeps_its_status_and_one_line_reason() -> None:
    client = _tracker(409, {"detail": "job x already ended (completed): there is nothing to cancel"})

    with pytest.raises(TrackerError) as refused:
        await client.cancel_job("x", "enough")

    assert refused.value.status_code == 409
    assert str(refused.value) == "job x already ended (completed): there is nothing to cancel"


async def test_the_in_process_transport_hands_over_each_event_as_it_is_written() -> None:
    # Prepare: an app that writes one event, then waits for the test before it ends the stream.
    release = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        view = json.dumps({"job_id": "j", "status": "running"})
        await send({"type": "http.response.body", "body": f"event: job\ndata: {view}\n\n".encode(),
                    "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"event: end\ndata: {}\n\n", "more_body": False})

    client = TrackerClient("http://tracker", transport=StreamingASGITransport(app))

    # Execute: read the first view while the app is still waiting.
    views = client.watch_job("j")
    first = await asyncio.wait_for(anext(views), 5)
    release.set()
    rest = [view async for view in views]

    # Assert
    assert first == {"job_id": "j", "status": "running"}
    assert rest == []
