"""The database port: a few SQL calls that read the same on SQLite and PostgreSQL."""

from apiary.db.base import Database, DatabaseUnavailable, Executor
from apiary.db.factory import make_database, sqlite_path

__all__ = ["Database", "DatabaseUnavailable", "Executor", "make_database", "sqlite_path"]
