"""The registries' id tables: a model's or dataset's integer id, allocated by the database (two uploads at
once get different ids; an id is never reused) and kept across restarts, with what storage recorded for it."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from apiary.db import Executor

COMPONENT = "tracker_registry"  # its own migrations, beside the tracker's views
Kind = Literal["models", "datasets"]
TABLES: dict[Kind, tuple[str, str]] = {"models": ("registered_models", "model_id"),
                                       "datasets": ("registered_datasets", "dataset_id")}

# Append only: a database records how many of these it has applied.
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS registered_models (
      model_id {autoid}, name TEXT NOT NULL, info TEXT, created_at DOUBLE PRECISION NOT NULL);
    CREATE TABLE IF NOT EXISTS registered_datasets (
      dataset_id {autoid}, name TEXT NOT NULL, info TEXT, created_at DOUBLE PRECISION NOT NULL)
    """,
]


async def allocate(tx: Executor, kind: Kind, name: str) -> int:
    """A new id for a registration, taken from the table's sequence (the row is filled in by `complete`)."""
    table, column = TABLES[kind]
    value = await tx.fetchval(f"INSERT INTO {table} (name, created_at) VALUES ($1, $2) RETURNING {column}",
                              name, time.time())
    return int(value)


async def complete(tx: Executor, kind: Kind, item_id: int, info: dict[str, Any]) -> None:
    """Record what storage holds for an allocated id: from now on it is listed."""
    table, column = TABLES[kind]
    await tx.execute(f"UPDATE {table} SET info = $2 WHERE {column} = $1", item_id, json.dumps(info))


async def abandon(tx: Executor, kind: Kind, item_id: int) -> None:
    """Drop an allocated id whose upload failed (the sequence never gives it again)."""
    table, column = TABLES[kind]
    await tx.execute(f"DELETE FROM {table} WHERE {column} = $1 AND info IS NULL", item_id)


async def remove(tx: Executor, kind: Kind, item_id: int) -> None:
    """Drop a registered id (its files are removed from storage by the caller; the id is never given again)."""
    table, column = TABLES[kind]
    await tx.execute(f"DELETE FROM {table} WHERE {column} = $1", item_id)


async def listed(db: Executor, kind: Kind) -> list[dict[str, Any]]:
    """Every registered model or dataset, newest first."""
    table, column = TABLES[kind]
    rows = await db.fetch(f"SELECT info FROM {table} WHERE info IS NOT NULL ORDER BY {column} DESC")
    return [dict(json.loads(row["info"])) for row in rows]


async def one(db: Executor, kind: Kind, item_id: int) -> dict[str, Any] | None:
    """One registered model or dataset, or None if the id names none."""
    table, column = TABLES[kind]
    info = await db.fetchval(f"SELECT info FROM {table} WHERE {column} = $1 AND info IS NOT NULL", item_id)
    return dict(json.loads(info)) if info else None
