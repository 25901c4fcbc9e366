"""The embedded stack's hold on its SQLite file: one `apiary run` per database at a time."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from apiary.db import sqlite_path
from apiary.settings import Settings


class DatabaseInUse(RuntimeError):
    """Another embedded process runs on this database."""


def lock_path(settings: Settings) -> Path | None:
    """The lock file of an embedded stack's database (in-memory bus on a SQLite file), else None."""
    database = settings.resolved_database_url()
    if not (settings.bus_url.startswith("memory:") and database.startswith("sqlite:")):
        return None
    file = sqlite_path(database)
    if not file or ":memory:" in file:
        return None
    return Path(f"{Path(file).resolve()}.lock")


def take(settings: Settings) -> int | None:
    """Hold the database alone (the lock's file descriptor, None when there is nothing to hold).

    Two such processes on one database would each publish the other's stored events on its own bus
    (the outboxes are tables) and resume the other's jobs; so the second one is refused.
    """
    path = lock_path(settings)
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DatabaseInUse(
            f"another apiary process is running on {path.with_suffix('')}: wait for it to end, or give this run"
            " its own APIARY_HOME") from None
    return fd


def held_elsewhere(settings: Settings) -> bool:
    """Whether an `apiary run` holds this database now (so its tracker, not the file, is current)."""
    try:
        fd = take(settings)
    except DatabaseInUse:
        return True
    if fd is not None:
        os.close(fd)
    return False


__all__ = ["DatabaseInUse", "held_elsewhere", "lock_path", "take"]
