"""Health checks for a process an orchestrator runs (Kubernetes probes, compose healthchecks).

`GET /healthz` answers 200 while the process's event loop runs (liveness); `GET /readyz` answers 200 when
every dependency check passes within `CHECK_TIMEOUT` seconds, else 503 with one line per failing check
(readiness: a service whose broker or database is away takes no traffic, and comes back by itself).
Served on `APIARY_HEALTH_PORT` by `apiary serve` and `apiary worker`; off when it is not set.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from apiary.bus import Bus
from apiary.db import Database

log = logging.getLogger("apiary.health")

Check = Callable[[], Awaitable[object]]
CHECK_TIMEOUT = 2.0
MAX_REQUEST_LINE = 8192


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


def _response(status: int, body: str) -> bytes:
    reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
    data = body.encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    return head.encode() + data


async def answer(path: str, checks: Mapping[str, Check]) -> bytes:
    """The HTTP response for one probe path."""
    if path == "/healthz":
        return _response(200, "ok\n")
    if path == "/readyz":
        problems = await failing(checks)
        return _response(503, "".join(f"{p}\n" for p in problems)) if problems else _response(200, "ready\n")
    return _response(404, "not found: use /healthz or /readyz\n")


async def serve_health(host: str, port: int, checks: Mapping[str, Check]) -> asyncio.Server:
    """Start answering probes on host:port (port 0: any free port; see `server.sockets`)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), CHECK_TIMEOUT)
            parts = line[:MAX_REQUEST_LINE].decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            writer.write(await answer(path, checks))
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port)
    log.info("health checks on http://%s:%d/readyz", host, server.sockets[0].getsockname()[1])
    return server


__all__ = ["Check", "answer", "bus_check", "database_check", "failing", "serve_health"]
