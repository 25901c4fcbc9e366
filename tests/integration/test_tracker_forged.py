"""The tracker applies no forged worker report to its views (on SQLite and PostgreSQL): a failure, progress
or heartbeat without the assignment's secret or token, or from another worker's broker user, is recorded as
forged and shown with the job, as is a task report the scheduler refused (`report.forged`); the genuine ones
count."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from apiary import proof
from apiary.bus.identity import worker_user
from apiary.bus.memory import MemoryBus
from apiary.bus.typed import publish_event
from apiary.contracts import ObjectRef, ReportForged, RoundStart, WorkerFailed, WorkerHeartbeat, WorkerProgress
from apiary.db import Database
from apiary.settings import Settings
from apiary.storage.local import LocalStorage
from services.tracker.service import Tracker
from services.tracker.views import job_view

SECRET = proof.new_secret()
TOKEN = proof.progress_token(SECRET)


async def _until(check: Any, what: str, within: float = 10.0) -> Any:
    deadline = time.monotonic() + within
    while not (value := await check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return value


async def test_forged_reports_change_no_view_and_are_shown_with_the_job(database: Database, tmp_path: Path) -> None:
    # Prepare: a round of one shard, whose digests round.start announces.
    bus = MemoryBus()
    await bus.connect()
    tracker = Tracker(bus, database, LocalStorage(tmp_path / "store"), Settings())
    await tracker.start()
    intruder = bus.as_user(worker_user("w2"))
    start = RoundStart(job_id="j", round=1, num_rounds=1, shards=[0], min_workers=1, deadline=time.time() + 60,
                       weights=ObjectRef(key="k", size=1, sha256="0" * 64),
                       secret_digests={0: proof.digest(SECRET)}, progress_digests={0: proof.digest(TOKEN)})
    try:
        await publish_event(bus, start)
        await _until(lambda: job_view(database, "j"), "the round to be recorded")

        # Execute: a failure with a guessed secret, progress with the secret's digest as token, progress
        # sent by another worker's broker user, a training heartbeat without a token; then genuine progress.
        await publish_event(bus, WorkerFailed(job_id="j", round=1, worker_id="w1", shard=0, error="x",
                                              secret="guess"))
        await publish_event(bus, WorkerProgress(job_id="j", round=1, worker_id="w1", shard=0, step=9,
                                                token=proof.digest(SECRET)))
        await publish_event(intruder, WorkerProgress(job_id="j", round=1, worker_id="w1", shard=0, step=8,
                                                     token=TOKEN))
        await publish_event(bus, WorkerHeartbeat(worker_id="w1", state="training", job_id="j", round=1, shard=0))
        # ... and a task report the scheduler refused, as it announces it
        await publish_event(bus, ReportForged(job_id="j", round=1, attempt=1, worker_id="w1", report="worker.evaluated",
                                              reason="a wrong assignment secret for the task"))
        await publish_event(bus, WorkerProgress(job_id="j", round=1, worker_id="w1", shard=0, step=3,
                                                metrics={"loss": 0.5}, token=TOKEN))
        view = await _until(lambda: _settled_view(database, 3, forged=5), "the genuine progress and 5 forged reports")
    finally:
        await tracker.stop()
        await bus.close()

    # Assert: the shard trains at the genuine step; five forged reports, each with why.
    shard = view["shards"][0]
    assert (shard["state"], shard["step"], shard["worker_id"]) == ("training", 3, "w1")
    reasons = sorted((f["routing_key"], f["reason"]) for f in view["forged"])
    assert reasons == [
        ("worker.evaluated", "a wrong assignment secret for the task"),
        ("worker.failed", "a wrong assignment secret for shard 0"),
        ("worker.heartbeat", "no progress token for shard 0"),
        ("worker.progress", "a wrong progress token for shard 0"),
        ("worker.progress", "sent by worker 'w2''s broker user, not by worker 'w1'"),
    ]


async def _settled_view(db: Database, step: int, *, forged: int) -> dict[str, Any] | None:
    """The job's view once the shard shows `step` and `forged` reports are recorded (in any order)."""
    view = await job_view(db, "j")
    done = view and view["shards"] and view["shards"][0]["step"] == step and len(view["forged"]) >= forged
    return view if done else None
