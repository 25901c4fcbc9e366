"""`apiary token create/list/revoke`: the HTTP API's tokens, kept (as hashes) in the tracker's database, and
the token `apiary run` makes for its own run, left in a file only its user can read."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from apiary.db import Database, make_database
from apiary.settings import Settings

RUN_TOKEN_FILE = "token"  # under APIARY_HOME, mode 0600, while `apiary run` serves its API


async def _database(settings: Settings) -> Database:
    from services.tracker import token_store

    db = make_database(settings.resolved_database_url())
    await db.connect()
    try:
        await token_store.migrate(db)
    except BaseException:
        await db.close()
        raise
    return db


async def create(settings: Settings, name: str, role: str) -> str:
    """A new token for `name` with `role` in the tracker's database; the only time it is seen."""
    from services.tracker import token_store

    db = await _database(settings)
    try:
        return await token_store.create(db, name, role)
    finally:
        await db.close()


async def listed(settings: Settings) -> list[dict[str, Any]]:
    """Every token's name, role and creation time."""
    from services.tracker import token_store

    db = await _database(settings)
    try:
        return await token_store.listed(db)
    finally:
        await db.close()


async def revoke(settings: Settings, name: str) -> None:
    """Forget the token named `name`."""
    from services.tracker import token_store

    db = await _database(settings)
    try:
        await token_store.revoke(db, name)
    finally:
        await db.close()


def write_run_token(home: Path, token: str) -> Path:
    """Leave the run's token where the CLI finds it (`home/token`), readable by this user alone."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / RUN_TOKEN_FILE
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return path


def read_run_token(home: Path) -> str | None:
    """The token a running `apiary run` left under `home`, if any."""
    try:
        return (home / RUN_TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def remove_run_token(home: Path, token: str) -> None:
    """Remove the run's token file, if it is still this run's."""
    if read_run_token(home) == token:
        with contextlib.suppress(OSError):
            (home / RUN_TOKEN_FILE).unlink()


__all__ = ["create", "listed", "read_run_token", "remove_run_token", "revoke", "write_run_token"]
