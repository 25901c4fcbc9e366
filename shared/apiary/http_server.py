"""Serving an ASGI app with uvicorn inside the process's own event loop (the tracker's API, health probes)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn


class _Server(uvicorn.Server):
    """uvicorn that says when it listens and leaves signals to the process that embeds it."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Ctrl-C belongs to the whole process (`apiary run`), not to its HTTP server.
        yield


class HttpServer:
    """An ASGI app on host:port (port 0: any free port), started and stopped with its owner; `what` and
    `setting` name it and its port's setting in the one line a port that is taken gives."""

    def __init__(self, app: Any, host: str, port: int, *, what: str = "the tracker's HTTP API",
                 setting: str = "APIARY_HTTP_PORT") -> None:
        self.app, self.host, self.port = app, host, port
        self.what, self.setting = what, setting
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        """The server's address, with the port it actually bound."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    async def start(self) -> str:
        """Bind, start serving, and return the address once it listens."""
        sock = _bind(self.host, self.port, self.what, self.setting)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=3)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name=f"http:{self.port}")
        ready = asyncio.create_task(self._server.ready.wait())
        await asyncio.wait({ready, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            await self._task  # raises what stopped uvicorn from starting
            raise RuntimeError(f"the HTTP server on {self.url} stopped while starting")
        return self.url

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (briefly), and wait for the server to end."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._server = self._task = None


def _bind(host: str, port: int, what: str, setting: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(
            e.errno, f"cannot serve {what} on {host}:{port} ({e.strerror}): "
                     f"set {setting} to a free port (0 picks one)",
        ) from e
    return sock


__all__ = ["HttpServer"]
