"""Test-wide fixtures: real services (RabbitMQ, PostgreSQL, moto S3) live in tests/fixtures.

Every case of tests/e2e and tests/faults starts a deployment or trains a real job: they are marked `slow` here,
by folder, and `scripts/test --fast` leaves them out (with the other tests marked `slow` where they stand)."""

import json
import os
import tempfile
from pathlib import Path

import pytest

pytest_plugins = [
    "tests.fixtures.services", "tests.fixtures.cluster", "tests.fixtures.embedded", "tests.fixtures.metrics",
    "tests.fixtures.served",
]

# What the test suite's jobs may reach (apiary.policy): the examples and the toy jobs, and data under the
# temporary folder (pytest's tmp_path) and the repository. Set before any Settings() is read; the cluster
# fixture passes them on to its processes.
os.environ.setdefault("APIARY_ALLOWED_ENTRYPOINTS", json.dumps(["examples.*", "tests.toyjobs.*"]))
REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("APIARY_DATA_ROOTS", json.dumps([tempfile.gettempdir(), str(REPO)]))

SLOW_FOLDERS = {REPO / "tests" / "e2e", REPO / "tests" / "faults"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the cases of the slow folders `slow`."""
    for item in items:
        if item.path.parent in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
