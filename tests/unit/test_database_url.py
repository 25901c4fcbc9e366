"""SQLite URLs name their file as SQLAlchemy reads them: three slashes, then the path."""

from __future__ import annotations

import pytest

from apiary.db import sqlite_path


@pytest.mark.parametrize(("url", "path"), [
    ("sqlite:///.apiary/apiary.db", ".apiary/apiary.db"),
    ("sqlite:///apiary.db", "apiary.db"),
    ("sqlite:////var/lib/apiary/apiary.db", "/var/lib/apiary/apiary.db"),
    ("sqlite://:memory:", ":memory:"),
    ("sqlite:relative.db", "relative.db"),
])
def test_a_sqlite_url_names_a_relative_or_absolute_file(url: str, path: str) -> None:
    assert sqlite_path(url) == path
