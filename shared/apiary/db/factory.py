"""Choose a database adapter from a URL."""

from __future__ import annotations

from apiary.db.base import Database


def sqlite_path(url: str) -> str:
    """The file a SQLite URL names, read as SQLAlchemy does: `sqlite:///relative/path`,
    `sqlite:////absolute/path`."""
    rest = url.removeprefix("sqlite:")
    if rest.startswith("//"):
        rest = rest[2:]  # the empty host
        rest = rest[1:] if rest.startswith("/") else rest  # the slash before the path
    return rest


def make_database(url: str) -> Database:
    """`sqlite:///path` for a local file, `postgresql://...` for PostgreSQL."""
    if url.startswith("sqlite:"):
        from apiary.db.sqlite import SqliteDatabase

        return SqliteDatabase(sqlite_path(url))
    if url.startswith(("postgresql://", "postgres://")):
        from apiary.db.postgres import PostgresDatabase

        return PostgresDatabase(url)
    raise ValueError(
        f"APIARY_DATABASE_URL {url!r} is not supported: use sqlite:///path or postgresql://host/db"
    )
