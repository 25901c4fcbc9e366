"""An exclusive lock between the processes of one machine (fcntl.flock on a lock file), held while one of them
makes what the others then reuse: a worker's model cache shared by several workers, a GGUF file's conversion."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

POLL = 0.1  # seconds between an async waiter's tries (it never blocks the event loop)


def _open(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold the lock on `path` (created if missing), waiting for it; released on exit, or if the process dies."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.asynccontextmanager
async def exclusive_async(path: Path) -> AsyncIterator[None]:
    """`exclusive` for a coroutine: waits without blocking the event loop, and stops waiting if cancelled.
    Every opening of the file is a lock of its own, so tasks of one process exclude each other too."""
    fd = _open(path)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(POLL)
        yield
    finally:
        os.close(fd)
