"""When a worker reads a job's end marker before training: only for assignments issued about when it
started listening for job ends or earlier, and no longer for a job whose marker was still missing well
after that (its end, if any, reaches the worker as an event). And which training process a worker's GPU readings
follow: the one of the trainer that ran its latest assignment."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from apiary.bus.memory import MemoryBus
from apiary.contracts import Assignment
from apiary.settings import Settings
from services.worker import Worker
from services.worker.job_ends import CLOCK_SKEW, MARKER_SETTLE, REREAD


def _assignment(job_id: str, marker: Path, issued_at: float) -> Assignment:
    return Assignment(
        job_id=job_id, round=1, job_name="toy", num_rounds=1, shard=0, num_shards=1, shard_num_samples=1,
        shard_url="file:///nowhere/shard.zip", shard_sha256="0" * 64, weights_url="file:///nowhere/w",
        weights_sha256="0" * 64, upload_url="file:///nowhere/r", result_key="r", entrypoint="m:f", env={},
        deadline=time.time() + 60, issued_at=issued_at, ended_url=marker.as_uri(),
    )


def _worker(tmp_path: Path, listening_for: float) -> Worker:
    worker = Worker(MemoryBus(), Settings(home=tmp_path / ".apiary"), worker_id="w")
    worker.ended.listening_since = time.time() - listening_for
    return worker


async def test_a_marker_found_skips_the_job(tmp_path: Path) -> None:
    marker = tmp_path / "ended.json"
    marker.write_text('{"reason": "cancelled by user"}')
    worker = _worker(tmp_path, listening_for=0)
    probe = worker.ended.probe(_assignment("j", marker, time.time() - 5))
    assert probe is not None and await probe
    assert worker.ended.reason("j") == "cancelled by user"


async def test_assignments_issued_well_after_listening_started_are_not_probed(tmp_path: Path) -> None:
    worker = _worker(tmp_path, listening_for=CLOCK_SKEW + 10)
    assert worker.ended.probe(_assignment("j", tmp_path / "ended.json", time.time())) is None


async def test_a_marker_missing_soon_after_listening_started_is_read_again_but_not_for_every_assignment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The aggregator may not have stored it yet: the job's marker is read again, REREAD seconds later at the soonest
    # (its rounds follow each other in milliseconds: a read per assignment would cost a request per contribution).
    worker = _worker(tmp_path, listening_for=1)
    marker = tmp_path / "ended.json"
    probe = worker.ended.probe(_assignment("j", marker, time.time() - 5))
    assert probe is not None and not await probe
    assert worker.ended.probe(_assignment("j", marker, time.time() - 5)) is None
    later = time.time() + REREAD
    monkeypatch.setattr(time, "time", lambda: later)
    marker.write_text('{"reason": "cancelled by user"}')
    probe = worker.ended.probe(_assignment("j", marker, later - 5))
    assert probe is not None and await probe
    assert worker.ended.reason("j") == "cancelled by user"


async def test_a_marker_missing_well_after_listening_started_is_not_read_again(tmp_path: Path) -> None:
    worker = _worker(tmp_path, listening_for=MARKER_SETTLE + 1)
    probe = worker.ended.probe(_assignment("j", tmp_path / "ended.json", time.time() - 5))
    assert probe is not None and not await probe
    assert worker.ended.probe(_assignment("j", tmp_path / "ended.json", time.time() - 5)) is None
    # Another job is still read.
    other = worker.ended.probe(_assignment("k", tmp_path / "ended.json", time.time() - 5))
    assert other is not None and not await other


class _Child:
    """A trainer seen only through its training process's pid."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid


def test_gpu_readings_follow_the_trainer_of_the_latest_assignment(tmp_path: Path) -> None:
    # Prepare: the user-function child runs from the worker's start; the built-in trainer's starts with a job of it
    worker = _worker(tmp_path, listening_for=0)
    worker._trainers = {"user_function": _Child(11), "causal_lm": _Child(22)}  # type: ignore[dict-item]
    assert worker._trainer_pid() == 11

    # Execute / Assert: a built-in job's assignment: its child, which holds the GPU memory now, is the one read
    worker.trainer_for(_assignment("j", tmp_path / "m", time.time()).model_copy(update={"entrypoint": None}))
    assert worker._trainer_pid() == 22
    # then a user-function job's again
    worker.trainer_for(_assignment("j", tmp_path / "m", time.time()))
    assert worker._trainer_pid() == 11
