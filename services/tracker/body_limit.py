"""How big a request's body may be, per route: refused with 413 and the limit, before it is read whole.

A body that declares its length (Content-Length) past the limit is answered before a byte of it is read; one
sent in chunks is counted as the route reads it and refused once it passes the limit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.tracker.schemas import Problem


@dataclass(frozen=True)
class Limit:
    """A route's limit in bytes, and what to do about a body past it."""

    size: int
    hint: str


# A route's limit, by method and path; None: unbounded (the route streams the body to disk).
LimitOf = Callable[[str, str], Limit | None]


def too_large(size: int | None, limit: Limit, method: str, path: str) -> str:
    """The 413's one line: how big the body is (None: not declared, it passed the limit as it came), the
    route's limit, and what to do."""
    how_big = f"is {size} bytes, over" if size is not None else "is over"
    return f"request body {how_big} the {limit.size}-byte limit of {method} {path}: {limit.hint}"


class BodyLimit:
    """ASGI middleware: each request's body within its route's limit (`limit_of`), else 413 with a Problem."""

    def __init__(self, app: ASGIApp, limit_of: LimitOf) -> None:
        self.app, self.limit_of = app, limit_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit_of(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        declared = _content_length(scope)
        if declared is not None and declared > limit.size:
            await _answer_413(send, too_large(declared, limit, method, path))
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit.size:
                # Raised inside the route's read of its body: FastAPI answers it like any HTTPException.
                raise HTTPException(413, too_large(None, limit, method, path))
            return message

        await self.app(scope, bounded, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _answer_413(send: Send, detail: str) -> None:
    body = json.dumps(Problem(detail=detail).model_dump()).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


__all__ = ["BodyLimit", "Limit", "LimitOf", "too_large"]
