"""A large fleet beats less often (apiary.pace), and nobody takes its slower beats for workers gone."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from apiary.bus.identity import worker_user
from services.app.runtime import Embedded
from services.worker import Worker
from tests.fixtures.embedded import StackFactory, toy_request


async def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _online(stack: Embedded) -> tuple[set[str], set[str]]:
    """The workers online in the tracker's view and in the scheduler's."""
    now = time.time()
    tracker = await stack.ports.db.fetch("SELECT worker_id FROM workers WHERE status = 'online'")
    scheduler = await stack.ports.db.fetch(
        "SELECT worker_id FROM worker_presence WHERE online = 1 AND last_seen >= $1",
        now - stack.scheduler.handlers._pace.offline_after(now))
    return {r["worker_id"] for r in tracker}, {r["worker_id"] for r in scheduler}


async def test_workers_beat_at_the_pace_the_fleet_calls_for_and_stay_online(
    embedded: StackFactory, toy_dataset: Path
) -> None:
    # Prepare: 3 workers beating every 0.5 s would send 6 beats a second, over a budget of 1.5: the pace is
    # stretched 4x (every 2 s). Offline after 1.5 s unstretched: a service judging by the unstretched time
    # would take every worker for gone between two beats.
    async with embedded(workers=3, presence_rate=1.5, worker_offline_after=1.5) as stack:
        ids = {w.worker_id for w in stack.workers}
        await _until(lambda: all(w.presence.beat_every == pytest.approx(2.0) for w in stack.workers), 15,
                     "every worker to beat every 2 s")

        # Execute: watch three beats' worth of time, then run a job that needs all three.
        seen: list[tuple[set[str], set[str]]] = []
        watch_until = time.monotonic() + 6.0
        while time.monotonic() < watch_until:
            seen.append(await _online(stack))
            await asyncio.sleep(0.25)
        job_id = await stack.submit(toy_request(toy_dataset, min_workers=3, max_workers=3))
        done = await stack.wait(job_id, timeout=120)

        # A worker leaves: 2 workers call for 2.83x (every 1.41 s), announced to those left.
        await stack.workers[0].stop()
        await _until(lambda: all(w.presence.beat_every == pytest.approx(0.5 * 2 * math.sqrt(2))
                                 for w in stack.workers[1:]), 15, "the two workers left to beat every 1.41 s")

    # Assert: no view lost a worker between beats 2 s apart, and the job found its three workers.
    assert all(tracker == ids and scheduler == ids for tracker, scheduler in seen), seen
    assert done["status"] == "completed", done.get("reason")


async def test_a_worker_that_joins_a_stretched_fleet_or_missed_its_pace_is_told_it(
    embedded: StackFactory,
) -> None:
    # Prepare: 3 workers beating every 0.5 s within 2.05 beats a second are stretched 4x (every 2 s), and so are
    # 4: the fourth joining changes no pace, so no announcement tells it (it beat every 0.5 s before).
    async with embedded(workers=3, presence_rate=2.05, worker_offline_after=1.5) as stack:
        await _until(lambda: all(w.presence.beat_every == pytest.approx(2.0) for w in stack.workers), 15,
                     "every worker to beat every 2 s")
        late = Worker(stack.ports.bus.as_user(worker_user("late")), stack.settings, worker_id="late")

        # Execute: the fourth joins; then one of the first three forgets the pace (a lost announcement).
        await late.start()
        try:
            await _until(lambda: late.presence.beat_every == pytest.approx(2.0), 15,
                         "the late worker to beat every 2 s")
            stack.workers[0].presence.beat_every = 0.5
            await _until(lambda: stack.workers[0].presence.beat_every == pytest.approx(2.0), 15,
                         "the forgetful worker to be told the pace again")
            paces = await stack.ports.db.fetch("SELECT routing_key FROM events WHERE routing_key LIKE 'presence.%'")
        finally:
            await late.stop()

    # Assert: both were told by the scheduler alone; the tracker recorded only the fleet's announcements.
    assert {r["routing_key"] for r in paces} == {"presence.pace"}
