"""A run that gives the worker's slot back before it ended: its files set aside from the job's working folder
(which the worker's next assignment reuses), and its last steps stopped with their job or the worker."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import pytest

from apiary.bus import Delivery
from apiary.contracts import Assignment
from apiary.secagg.settings import SecureAggregation
from services.worker.host import Host, Workspace, left_aside
from services.worker.pipeline import AssignmentRun
from services.worker.slot import HandedOff


async def settle() -> None:
    """Let cancelled tasks end and their done callbacks run."""
    for _ in range(3):
        await asyncio.sleep(0)


def assignment(job_id: str, shard: int) -> Assignment:
    return Assignment(job_id=job_id, round=1, job_name="n", num_rounds=2, shard=shard, env={}, deadline=0.0)


def test_a_set_aside_run_keeps_its_files_while_the_next_run_replaces_the_working_folders(tmp_path: Path) -> None:
    space = Workspace(tmp_path / "job")
    space.clear_outputs()
    space.weights.write_bytes(b"round 1")
    space.result.write_bytes(b"trained 0")
    (space.out_dir / "log.txt").write_text("shard 0")

    aside = space.set_aside("1-1-0", assignment("job", 0))

    # The next run of the job: its outputs cleared, its weights downloaded afresh (the file unlinked first).
    space.clear_outputs()
    space.weights.unlink()
    space.weights.write_bytes(b"round 1, attempt 2")
    space.result.write_bytes(b"trained 1")
    assert aside.weights.read_bytes() == b"round 1"
    assert aside.result.read_bytes() == b"trained 0"
    assert (aside.out_dir / "log.txt").read_text() == "shard 0"
    assert not (space.out_dir / "log.txt").exists()

    aside.remove()
    assert not aside.job_dir.exists() and space.result.read_bytes() == b"trained 1"


def test_setting_aside_replaces_what_a_stopped_worker_left_under_the_same_name(tmp_path: Path) -> None:
    space = Workspace(tmp_path / "job")
    left = space.work / "aside" / "1-1-0" / "work"
    left.mkdir(parents=True)
    (left / "result.safetensors").write_bytes(b"old")
    space.clear_outputs()
    space.weights.write_bytes(b"w")
    space.result.write_bytes(b"new")
    assert space.set_aside("1-1-0", assignment("job", 0)).result.read_bytes() == b"new"


def test_a_worker_starting_finds_the_runs_its_killed_process_set_aside_with_their_assignments(tmp_path: Path) -> None:
    cache = tmp_path / "worker-1"
    given = {shard: assignment("job", shard) for shard in (0, 1, 2)}
    for shard in (0, 1, 2):
        space = Workspace(cache / "jobs" / "job")
        space.clear_outputs()
        space.weights.write_bytes(b"w")
        space.result.write_bytes(f"trained {shard}".encode())
        aside = space.set_aside(f"1-1-{shard}", given[shard])
        if shard == 1:
            aside.mark_reported()  # reported before the kill: nothing to say for it
        if shard == 2:
            (aside.job_dir / "assignment.json").write_text("{")  # unreadable: only removed

    found = left_aside(cache)

    # Only shard 0's is left to report: shard 1's was reported, shard 2's assignment cannot be read.
    assert [(f.space.job_dir.name, f.assignment and f.assignment.shard) for f in found] == [
        ("1-1-0", 0), ("1-1-1", None), ("1-1-2", None)]
    assert found[0].assignment == given[0]
    assert left_aside(tmp_path / "worker-2") == []


async def test_handed_off_steps_stop_with_their_job_and_all_with_the_worker() -> None:
    handed = HandedOff()
    ran: list[str] = []

    async def steps(name: str) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ran.append(f"{name} stopped")
            raise

    handed.start(assignment("a", 0), steps("a0"), "a0")
    handed.start(assignment("a", 1), steps("a1"), "a1")
    handed.start(assignment("b", 0), steps("b0"), "b0")
    await asyncio.sleep(0)
    assert sorted(a.shard for a in handed.stop("a")) == [0, 1]
    await settle()
    assert sorted(ran) == ["a0 stopped", "a1 stopped"] and len(handed) == 1
    await handed.cancel()
    assert "b0 stopped" in ran and len(handed) == 0


async def test_steps_that_end_or_fail_are_forgotten(caplog: pytest.LogCaptureFixture) -> None:
    handed = HandedOff()

    async def fails() -> None:
        raise RuntimeError("boom")

    async def ends() -> None:
        return None

    handed.start(assignment("a", 0), fails(), "a0")
    handed.start(assignment("a", 1), ends(), "a1")
    await settle()
    assert len(handed) == 0
    assert any("ended in an error" in r.getMessage() and "boom" in r.getMessage() for r in caplog.records)


class Reporter:
    """The part of a worker a run that ends at once uses: its id, its folder, and its failure reports."""

    def __init__(self, cache: Path) -> None:
        self.worker_id, self.cache = "w2", cache
        self.failures: list[tuple[int, str]] = []

    async def failed(self, a: Assignment, error: str) -> None:
        self.failures.append((a.shard, error))


async def test_a_secure_assignment_back_from_a_lost_worker_is_reported_failed_without_training(tmp_path: Path) -> None:
    # Prepare: a secure shard's assignment that came back to the pool from a worker that was lost after taking it.
    secure = SecureAggregation(num_shares=1, reconstruction_threshold=2)
    a = assignment("job", 3).model_copy(update={"secure_aggregation": secure, "secret": "s3"})
    worker = Reporter(tmp_path)
    came_back = Delivery("assign.pool", b"", redelivered=True, returned=True)

    # Execute
    trained = await AssignmentRun(cast(Host, worker), a, rate=lambda: None, delivery=came_back).run(None)

    # Assert: reported failed, nothing downloaded or trained (no folder made for the job).
    assert trained is None
    assert worker.failures == [(3, "secure aggregation: the worker that took the shard was lost (its assignment came "
                                   "back to the queue); its part of the key agreement cannot be taken over")]
    assert not (tmp_path / "jobs").exists()
