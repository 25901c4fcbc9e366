"""The tracker's API served inside this process: an httpx transport that streams an ASGI app's responses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

from services.tracker.api_path import IN_PROCESS_SCOPE_KEY
from services.tracker.client import TrackerClient

if TYPE_CHECKING:
    from services.tracker.api import ApiTracker

Message = dict[str, Any]


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """Requests to an ASGI app in this event loop; unlike httpx.ASGITransport, which returns once the
    whole body is written, a response comes back as soon as it starts, so Server-Sent Events stream."""

    def __init__(self, app: Any, *, trusted: bool = False) -> None:
        self.app = app
        # A trusted transport's requests act as admin, no token needed (see services.tracker.auth).
        self.trusted = trusted

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Run the app on the request; return its response, its body still being written."""
        exchange = _Exchange(request.stream)  # type: ignore[arg-type]  # an async transport gets an async stream
        task = asyncio.create_task(self._run(request, exchange), name="tracker:in-process-request")
        waiters: set[asyncio.Future[Any]] = {exchange.started, task}
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if not exchange.started.done():
            task.result()  # raises what stopped the app before it answered
            raise RuntimeError(f"the tracker's app ended without answering {request.method} {request.url.path}")
        status, headers = exchange.started.result()
        if status >= 500:
            # The app's own error says more than its 500 (e.g. the tracker's tables are missing).
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return httpx.Response(status, headers=headers, stream=_Body(exchange, task))

    async def _run(self, request: httpx.Request, exchange: _Exchange) -> None:
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "headers": [(k.lower(), v) for k, v in request.headers.raw], "scheme": request.url.scheme,
            "path": request.url.path, "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query, "server": (request.url.host, request.url.port),
            "client": ("127.0.0.1", 0), "root_path": "",
        }
        if self.trusted:
            scope[IN_PROCESS_SCOPE_KEY] = True
        try:
            await self.app(scope, exchange.receive, exchange.send)
        finally:
            exchange.chunks.put_nowait(None)


class _Exchange:
    """One request's ASGI channel: the request body in, the response start and body chunks out."""

    def __init__(self, body: AsyncIterable[bytes]) -> None:
        # Read a chunk at a time as the app asks for it: a model registered in-process is never held whole.
        self.body: AsyncIterator[bytes] | None = aiter(body)
        self.started: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] = \
            asyncio.get_running_loop().create_future()
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.disconnected = asyncio.Event()

    async def receive(self) -> Message:
        if self.body is not None:
            chunk = await anext(self.body, None)
            if chunk is not None:
                return {"type": "http.request", "body": chunk, "more_body": True}
            self.body = None
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and not self.started.done():
            self.started.set_result((message["status"], list(message.get("headers", []))))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                self.chunks.put_nowait(bytes(message["body"]))
            if not message.get("more_body", False):
                self.chunks.put_nowait(None)


class _Body(httpx.AsyncByteStream):
    """A response body read as the app writes it; closing it disconnects the app's request."""

    def __init__(self, exchange: _Exchange, task: asyncio.Task[None]) -> None:
        self.exchange, self.task = exchange, task

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.exchange.chunks.get()) is not None:
            yield chunk

    async def aclose(self) -> None:
        self.exchange.disconnected.set()
        if not self.task.done():
            self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


def in_process_client(tracker: ApiTracker, *, token: str | None = None) -> TrackerClient:
    """A client of this tracker's API that never leaves the process (no port, no socket): trusted as admin,
    since it holds the tracker's database already, unless it carries a `token` to act as that token."""
    from services.tracker.api import create_app

    transport = StreamingASGITransport(create_app(tracker), trusted=token is None)
    return TrackerClient("http://tracker.in-process", transport=transport, token=token)


__all__ = ["StreamingASGITransport", "in_process_client"]
