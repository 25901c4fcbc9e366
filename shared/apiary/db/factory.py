"""Choose a database adapter from a URL."""

from __future__ import annotations

from apiary.db.base import Database


def make_database(url: str) -> Database:
    """`sqlite:///path` for a local file, `postgresql://...` for PostgreSQL."""
    if url.startswith("sqlite:"):
        from apiary.db.sqlite import SqliteDatabase

        return SqliteDatabase(url.removeprefix("sqlite:").removeprefix("//"))
    if url.startswith(("postgresql://", "postgres://")):
        from apiary.db.postgres import PostgresDatabase

        return PostgresDatabase(url)
    raise ValueError(
        f"APIARY_DATABASE_URL {url!r} is not supported: use sqlite:///path or postgresql://host/db"
    )
