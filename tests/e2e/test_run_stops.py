"""A job never outlives the `apiary run` that runs it as "running": stopped, it is cancelled; killed, the next
run on the same home marks it failed (its in-memory messages are gone, so nothing else would end it)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.app.runtime import ORPHANED, DatabaseInUse
from tests.fixtures.embedded import REPO, StackFactory, toy_request
from tests.fixtures.policy import foreign

SLOW = {"mode": "slow", "slow_seconds": 60}  # a shard that is still training when the run is stopped


def _job_file(tmp_path: Path, dataset: Path, **distributed: int) -> Path:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({**toy_request(dataset, **distributed), "config": SLOW}))
    return job


def _start(job: Path, home: Path, *args: str) -> subprocess.Popen[str]:
    environment = {k: v for k, v in os.environ.items() if not foreign(k)}
    environment["APIARY_HOME"] = str(home)
    environment["APIARY_HTTP_PORT"] = "0"  # a free port: other tests run `apiary run` at the same time
    # Ctrl-C reaches the run as at a terminal, even where this test runs with SIGINT ignored.
    return subprocess.Popen(
        [sys.executable, "-m", "services.app.cli", "run", str(job), "--workers", "2", "--json", *args],
        cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _rows(home: Path, sql: str) -> list[tuple[object, ...]]:
    database = home / "apiary.db"
    if not database.exists():
        return []
    with sqlite3.connect(database) as conn:
        try:
            return conn.execute(sql).fetchall()
        except sqlite3.OperationalError:  # a table not created yet, or the database busy
            return []


def _wait_until_training(home: Path, run: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not _rows(home, "SELECT 1 FROM shard_views WHERE state = 'training'"):
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.1)


@pytest.mark.parametrize(("sig", "code", "said"), [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_stopped_run_cancels_its_job(tmp_path: Path, toy_dataset: Path, sig: int, code: int, said: str) -> None:
    # Prepare
    home = tmp_path / ".apiary"
    run = _start(_job_file(tmp_path, toy_dataset, num_rounds=3, max_workers=2), home)
    _wait_until_training(home, run)

    # Execute
    run.send_signal(sig)
    out, err = run.communicate(timeout=60)

    # Assert: the job ended cancelled, saying why, and nothing of it is left running.
    assert run.returncode == code, err[-2000:]
    result = json.loads(out)
    assert result["status"] == "cancelled" and result["reason"] == f"interrupted: apiary run got {said}"
    assert _rows(home, "SELECT status, reason FROM job_views") == [("cancelled", result["reason"])]
    assert _rows(home, "SELECT status FROM jobs") == [("cancelled",)]
    assert _rows(home, "SELECT status FROM rounds") == [("cancelled",)]
    assert _rows(home, "SELECT status FROM round_views") == [("cancelled",)]
    assert "Traceback" not in err


def test_a_run_past_its_timeout_cancels_its_job(tmp_path: Path, toy_dataset: Path) -> None:
    home = tmp_path / ".apiary"
    run = _start(_job_file(tmp_path, toy_dataset, num_rounds=3, max_workers=2), home, "--timeout", "3")

    out, err = run.communicate(timeout=120)

    assert run.returncode == 1, err[-2000:]
    result = json.loads(out)
    assert result["status"] == "cancelled"
    assert result["reason"] == "apiary run --timeout 3: the job did not end in time"
    assert _rows(home, "SELECT status FROM job_views") == [("cancelled",)]


async def test_a_job_left_running_by_a_dead_run_is_failed_by_the_next_run(
    embedded: StackFactory, toy_dataset: Path
) -> None:
    # Prepare: a run whose job is training; a second run on the same home meanwhile is refused.
    request = {**toy_request(toy_dataset, num_rounds=3, min_workers=1, max_workers=1), "config": SLOW}
    async with embedded(workers=1) as first:
        job_id = await first.submit(request)
        await first.wait(job_id, timeout=30, until=lambda v: v["status"] == "running")
        with pytest.raises(DatabaseInUse, match=r"^another apiary process is running on .*apiary\.db: wait for it"):
            async with embedded(workers=1):
                pass
        running_beside = await first.ports.db.fetchval("SELECT status FROM jobs WHERE job_id = $1", job_id)
    # The first run ended without ending its job, as a killed process would.

    # Execute
    async with embedded(workers=1) as after:
        view = await after.wait(job_id, timeout=30)
        rounds = await after.ports.db.fetch("SELECT status, reason FROM rounds WHERE job_id = $1", job_id)

    # Assert: left alone while its run was alive; failed, saying why, once it was not.
    assert running_beside == "running"
    assert view["status"] == "failed" and view["reason"] == ORPHANED
    assert [r["status"] for r in view["rounds"]] == ["failed"]
    assert rounds == [{"status": "failed", "reason": ORPHANED}]


def test_a_second_run_on_the_same_home_is_refused_in_one_line(tmp_path: Path, toy_dataset: Path) -> None:
    home = tmp_path / ".apiary"
    job = _job_file(tmp_path, toy_dataset, num_rounds=3, max_workers=2)
    first = _start(job, home)
    try:
        _wait_until_training(home, first)

        second = _start(job, home)
        out, err = second.communicate(timeout=120)
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=60)

    assert second.returncode == 2 and out == ""
    assert err.strip() == (f"error: another apiary process is running on {home.resolve() / 'apiary.db'}: wait for"
                           " it to end, or give this run its own APIARY_HOME")
    assert first.returncode == 130
