"""Health checks for a process an orchestrator runs (Kubernetes probes, compose healthchecks).

`GET /healthz` answers 200 while the process's event loop runs (liveness); `GET /readyz` answers 200 when
every dependency check passes within `CHECK_TIMEOUT` seconds, else 503 with one line per failing check
(readiness: a service whose broker or database is away takes no traffic, and comes back by itself).
Served on `APIARY_HEALTH_PORT` by `apiary serve` and `apiary worker`, through uvicorn as the tracker's API
is; off when it is not set.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.responses import PlainTextResponse

from apiary.bus import Bus
from apiary.db import Database
from apiary.http_server import HttpServer

log = logging.getLogger("apiary.health")

Check = Callable[[], Awaitable[object]]
CHECK_TIMEOUT = 2.0


def bus_check(bus: Bus, queue: str) -> Check:
    """The broker answers: a passive look at one of the process's own queues."""
    return lambda: bus.queue_size(queue)


def database_check(db: Database) -> Check:
    """The database answers a trivial query."""
    return lambda: db.fetchval("SELECT 1")


async def failing(checks: Mapping[str, Check], timeout: float = CHECK_TIMEOUT) -> list[str]:
    """One line per check that raised or did not answer within `timeout` seconds (empty: all passed)."""

    async def run(name: str, check: Check) -> str | None:
        try:
            await asyncio.wait_for(check(), timeout)
        except TimeoutError:
            return f"{name}: no answer within {timeout:g} s"
        except Exception as e:  # a health check reports any failure; it never raises
            return f"{name}: {type(e).__name__}: {e}".splitlines()[0]
        return None

    results = await asyncio.gather(*(run(name, check) for name, check in checks.items()))
    return [line for line in results if line]


async def answer(path: str, checks: Mapping[str, Check]) -> tuple[int, str]:
    """The status and plain-text body for one probe path."""
    if path == "/healthz":
        return 200, "ok\n"
    if path == "/readyz":
        problems = await failing(checks)
        return (503, "".join(f"{p}\n" for p in problems)) if problems else (200, "ready\n")
    return 404, "not found: use /healthz or /readyz\n"


class HealthApp:
    """The probe paths as an ASGI app (any method; the query is ignored)."""

    def __init__(self, checks: Mapping[str, Check]) -> None:
        self.checks = checks

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Answer one HTTP request (uvicorn runs it with lifespan events off)."""
        status, body = await answer(scope["path"], self.checks)
        await PlainTextResponse(body, status)(scope, receive, send)


async def serve_health(host: str, port: int, checks: Mapping[str, Check]) -> HttpServer:
    """Start answering probes on host:port (port 0: any free port; see `.port`); `stop()` ends it."""
    server = HttpServer(HealthApp(checks), host, port, what="health checks", setting="APIARY_HEALTH_PORT")
    await server.start()
    log.info("health checks on http://%s:%d/readyz", host, server.port)
    return server


__all__ = ["Check", "HealthApp", "answer", "bus_check", "database_check", "failing", "serve_health"]
