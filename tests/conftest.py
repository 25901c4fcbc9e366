"""Test-wide fixtures: real services (RabbitMQ, PostgreSQL, moto S3) live in tests/fixtures."""

import json
import os
import tempfile
from pathlib import Path

pytest_plugins = ["tests.fixtures.services", "tests.fixtures.cluster", "tests.fixtures.embedded"]

# What the test suite's jobs may reach (apiary.policy): the examples and the toy jobs, and data under the
# temporary folder (pytest's tmp_path) and the repository. Set before any Settings() is read; the cluster
# fixture passes them on to its processes.
os.environ.setdefault("APIARY_ALLOWED_ENTRYPOINTS", json.dumps(["examples.*", "tests.toyjobs.*"]))
REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("APIARY_DATA_ROOTS", json.dumps([tempfile.gettempdir(), str(REPO)]))
