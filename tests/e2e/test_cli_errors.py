"""User mistakes at the command line get one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.embedded import REPO
from tests.fixtures.policy import foreign


def _apiary(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not foreign(k)}
    environment.update({"APIARY_HOME": str(home), "APIARY_HTTP_PORT": "0", **env})
    return subprocess.run([sys.executable, "-m", "services.app.cli", *args], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("content", "message"),
    [("name: [\n", "is not valid YAML"), ("- just\n- a list\n", "must hold a mapping")],
)
def test_a_broken_job_file_is_one_line(tmp_path: Path, content: str, message: str) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(content)

    done = _apiary("run", str(job), home=tmp_path)

    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_status_of_an_unknown_job_is_one_line(tmp_path: Path) -> None:
    done = _apiary("status", "nope", home=tmp_path)

    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: no job 'nope' is known")
    assert len(done.stderr.strip().splitlines()) == 1


def test_submit_to_a_dead_broker_is_one_line(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: x\nentrypoint: a.b\ndataset: d\n")

    done = _apiary("submit", str(job), home=tmp_path, APIARY_BUS_URL="amqp://guest:guest@127.0.0.1:1/")

    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        line for line in done.stderr.strip().splitlines() if line.startswith("error: cannot reach")
    ]
    assert "check APIARY_BUS_URL" in done.stderr
