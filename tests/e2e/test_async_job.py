"""Whole async (FedBuff) jobs on the embedded adapters: fast workers never wait for a slow one, and every version
is exactly FedBuff's step over the updates it folded."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from apiary import keys
from apiary.contracts import decode_body
from apiary.jobspec_async import AsyncConfig
from apiary.strategies.buffered import staleness_weight
from apiary.weights import loads
from services.app.render import render_job
from services.tracker.schemas import JobDetail
from tests.fixtures.embedded import StackFactory, toy_request
from tests.toyjobs.toy import Gates

SLOW = 3  # the shard held back (its worker is "slow")


async def _wait_for(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_fast_workers_never_wait_for_the_slow_one(embedded: StackFactory, tmp_path: Path,
                                                        toy_dataset: Path) -> None:
    # Prepare: 4 workers, one shard each; shard 3 is held until the test opens its gate, so it is as slow as the
    # test wants: three versions must be made without it.
    gates = Gates(tmp_path)
    request = toy_request(toy_dataset, num_rounds=6, min_workers=4, max_workers=4, mode="async", evaluate_every=0,
                          **{"async": {"buffer_size": 2, "staleness_weight": "polynomial"}})
    request["config"] = {"mode": "gated", "fail_shards": [SLOW], "gate": gates.path}
    async with embedded(workers=4) as stack:
        db = stack.ports.db
        job_id = await stack.submit(request)

        async def versions_made() -> int:
            return int(await db.fetchval("SELECT COUNT(*) FROM aggregations WHERE job_id = $1 AND status ="
                                         " 'aggregated'", job_id) or 0)

        # Execute: three versions come from the fast shards while the slow one trains its first task.
        async def three() -> bool:
            return await versions_made() >= 3
        await _wait_for(three, 120)
        slow_reports_before = await db.fetchval("SELECT COUNT(*) FROM contributions WHERE job_id = $1 AND shard = $2",
                                                job_id, SLOW)
        gates.open_through(7)
        view = await stack.wait(job_id, timeout=120)
        folds = await db.fetch("SELECT * FROM async_folds WHERE job_id = $1 ORDER BY seq", job_id)
        tasks = {(r["round"], r["attempt"], r["shard"]): r for r in await db.fetch(
            "SELECT * FROM async_tasks WHERE job_id = $1", job_id)}
        storage = stack.ports.storage
        versions = [loads(await storage.get_bytes(keys.global_weights(job_id, v))) for v in range(1, 7)]
        start = loads(await storage.get_bytes(keys.global_weights(job_id, 0)))
        updates = {(f["round"], f["attempt"], f["shard"]): loads(await storage.get_bytes(f["result_key"]))
                   for f in folds}
        starts = {t["weights_key"]: loads(await storage.get_bytes(t["weights_key"])) for t in tasks.values()}
        final = loads(await storage.get_bytes(keys.final_model(job_id)))

    # Assert: the job completed; nothing of shard 3 arrived while three versions were made.
    assert view["status"] == "completed", view.get("reason")
    assert slow_reports_before == 0
    first_three = [f for f in folds if f["version"] <= 3]
    assert first_three and all(f["shard"] != SLOW for f in first_three)
    assert all(sum(1 for f in folds if f["version"] == v) == 2 for v in range(1, 7))
    slow = [f for f in folds if f["shard"] == SLOW]
    assert all(f["staleness"] >= 3 for f in slow[:1])  # its first update, if folded, was >= 3 versions old
    # Every version is FedBuff's step (server learning rate 1, no momentum) over the updates it folded.
    settings = AsyncConfig(staleness_weight="polynomial")
    previous = start
    for index, made in enumerate(versions, start=1):
        mine = [f for f in folds if f["version"] == index]
        total = sum(f["samples"] for f in mine)
        for name in ("layer.weight", "layer.bias"):
            step = sum(f["samples"] * staleness_weight(settings, f["staleness"]) * (
                updates[(f["round"], f["attempt"], f["shard"])][name].double()
                - starts[tasks[(f["round"], f["attempt"], f["shard"])]["weights_key"]][name].double())
                for f in mine) / total
            torch.testing.assert_close(made[name].double(), previous[name].double() + step, rtol=0, atol=1e-5)
        assert all(f["staleness"] == index - f["round"] for f in mine)
        previous = made
    torch.testing.assert_close(final["layer.weight"], versions[-1]["layer.weight"])


async def test_tasks_still_training_after_the_last_version_stop_while_the_job_evaluates(
        embedded: StackFactory, tmp_path: Path, toy_dataset: Path) -> None:
    # Shard 3's first task is held for good; the last version is made from the other shards, and the job's final
    # evaluation is held until the test opens it: meanwhile no training task of the job may still run.
    gates, evaluated = Gates(tmp_path), tmp_path / "evaluate"
    request = toy_request(toy_dataset, num_rounds=3, min_workers=4, max_workers=4, mode="async", evaluate_every=0,
                          **{"async": {"buffer_size": 2}})
    request["config"] = {"mode": "gated", "fail_shards": [SLOW], "gate": gates.path, "gate_seconds": 600,
                         "eval_mode": "gated", "eval_gate": str(evaluated)}
    async with embedded(workers=4) as stack:
        job_id = await stack.submit(request)

        def training() -> list[tuple[str, int]]:
            return [(w.worker_id, w.slot.current.shard) for w in stack.workers
                    if w.slot.current is not None and w.slot.current.job_id == job_id
                    and w.slot.current.task == "train"]

        async def evaluating_alone() -> bool:
            last = await stack.ports.db.fetchval("SELECT last_round FROM jobs WHERE job_id = $1", job_id)
            return last is not None and not training()

        await _wait_for(evaluating_alone, 120)
        view = await stack.api.get_job(job_id)
        evaluated.touch()
        ended = await stack.wait(job_id, timeout=120)
        slow_reports = await stack.ports.db.fetchval(
            "SELECT COUNT(*) FROM contributions WHERE job_id = $1 AND shard = $2", job_id, SLOW)
        slots = await stack.ports.db.fetch("SELECT status, COUNT(*) AS n FROM async_slots WHERE job_id = $1"
                                           " GROUP BY status ORDER BY status", job_id)

    assert view["status"] == "running"  # the final evaluation still held: the job had not ended
    assert ended["status"] == "completed", ended.get("reason")
    assert slow_reports == 0  # the held task was stopped, never reported
    # The API no longer lists it as out: the dashboard shows it stopped, with why.
    assert ended["asynchronous"]["tasks"] == []
    assert "training" not in {r["status"] for r in slots} and "stopped" in {r["status"] for r in slots}


async def test_async_job_status_counts_versions(embedded: StackFactory, toy_dataset: Path) -> None:
    request = toy_request(toy_dataset, num_rounds=3, min_workers=2, max_workers=3, mode="async", evaluate_every=0,
                          **{"async": {"buffer_size": 2, "staleness_weight": "constant"}})
    async with embedded(workers=2) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        rounds = await stack.ports.db.fetch("SELECT round, status FROM aggregations WHERE job_id = $1 ORDER BY round",
                                            job_id)

    assert view["status"] == "completed", view.get("reason")
    assert [(r["round"], r["status"]) for r in rounds] == [(1, "aggregated"), (2, "aggregated"), (3, "aggregated")]
    buffered = view["asynchronous"]
    assert (buffered["versions"], buffered["updates"], buffered["buffer_size"]) == (3, 6, 2)
    assert sum(h["count"] for h in buffered["staleness_histogram"]) == 6
    assert sum(w["updates"] for w in buffered["workers"]) == 6 and all(w["per_minute"] > 0 for w in buffered["workers"])
    JobDetail.model_validate(view)  # what the API answers
    shown = Console(width=200, record=True)
    shown.print(render_job(view))
    text = shown.export_text()
    assert "version 3/3" in text and "async: 3 versions of K=2 from 6 updates" in text, text


async def test_an_entrypoint_that_raises_fails_an_async_job_without_waiting_for_the_timeout(
        embedded: StackFactory, toy_dataset: Path) -> None:
    request = toy_request(toy_dataset, num_rounds=3, min_workers=2, max_workers=2, mode="async", evaluate_every=0,
                          aggregation_timeout=600, fault_tolerance=1)
    request["config"] = {"mode": "raise"}
    async with embedded(workers=2) as stack:
        view = await stack.wait(await stack.submit(request), timeout=90)

    assert view["status"] == "failed"
    assert "failed 2 time(s) in a row" in view["reason"] and "RuntimeError: toy failure on shard" in view["reason"]


async def test_a_task_whose_report_never_comes_loses_its_slot_at_its_deadline_and_its_shard_trains_again(
        embedded: StackFactory, tmp_path: Path, toy_dataset: Path) -> None:
    # Prepare: 4 workers, one shard each, every shard training at once; the first report of shard 3 is lost on
    # its way (its worker stays alive and heartbeating, as a worker that hangs after training would): with no
    # deadline of its own, the task would hold its slot, and shard 3 would never train again. Each task waits at a
    # gate named by its number: the first four (version 1's, shard 3's among them) go; the rest wait until the lost
    # task's deadline has passed, so the job is still running then. The open version holds an update (one of the
    # first four lands in version 2) and is made from it at its timeout; the next one's timeout comes a whole
    # timeout after the lost task's deadline, long after the gates open.
    gates = Gates(tmp_path, opened=4, by="attempt")
    request = toy_request(toy_dataset, num_rounds=6, min_workers=4, max_workers=4, mode="async", evaluate_every=0,
                          aggregation_timeout=30, **{"async": {"buffer_size": 2}})
    request["config"] = {"mode": "gated", "gate": gates.path}
    async with embedded(workers=4) as stack:
        db = stack.ports.db
        lost: list[int] = []

        def losing(publish: Any) -> Any:
            async def maybe(key: str, body: bytes, **kwargs: Any) -> None:
                if key in ("worker.done.async", "worker.failed.async") and not lost:
                    report = decode_body(body)
                    if report["shard"] == SLOW:
                        lost.append(int(report["attempt"]))
                        return
                await publish(key, body, **kwargs)
            return maybe

        for worker in stack.workers:
            worker.bus.publish = losing(worker.bus.publish)  # type: ignore[method-assign]
        job_id = await stack.submit(request)

        # Execute: wait for the lost task's deadline to free its slot, then let every task go on.
        async def slot_lost() -> bool:
            return bool(lost) and await db.fetchval("SELECT status FROM async_slots WHERE job_id = $1 AND attempt"
                                                    " = $2", job_id, lost[0]) == "lost"
        await _wait_for(slot_lost, 90)
        gates.open_through(200, first=5)
        view = await stack.wait(job_id, timeout=120)
        slots = await db.fetch("SELECT attempt, shard, status FROM async_slots WHERE job_id = $1 ORDER BY attempt",
                               job_id)

    # Assert: the job completed, and shard 3 trained again after its lost task and reported.
    assert view["status"] == "completed", view.get("reason")
    assert len(lost) == 1
    assert any(r["shard"] == SLOW and r["attempt"] > lost[0] and r["status"] == "done" for r in slots)


HOLD = 2.0  # how long each task of the next test trains (at its gate), so a worker may wait up to that long


@pytest.mark.parametrize("version_wait", [0.0, 1.0])
async def test_equal_workers_wait_for_the_version_their_reports_are_about_to_make(
        embedded: StackFactory, tmp_path: Path, toy_dataset: Path, version_wait: float) -> None:
    # Prepare: 2 workers, one shard each, K=2: each version folds one update of each. Each task waits at a gate
    # named by its number; the test opens a version's two gates together, HOLD s after its tasks went out, so the
    # second report is due when the first comes, and fills the buffer.
    gates = Gates(tmp_path, by="attempt")
    request = toy_request(toy_dataset, num_rounds=2, min_workers=2, max_workers=2, mode="async", evaluate_every=0,
                          **{"async": {"buffer_size": 2, "version_wait": version_wait}})
    request["config"] = {"mode": "gated", "gate": gates.path}
    async with embedded(workers=2) as stack:
        db = stack.ports.db
        job_id = await stack.submit(request)

        async def tasks_out(count: int) -> bool:
            return int(await db.fetchval("SELECT COUNT(*) FROM async_slots WHERE job_id = $1", job_id) or 0) >= count

        # Execute: version 1's two tasks train HOLD s and report together; then the next two do.
        await _wait_for(lambda: tasks_out(2), 60)
        await asyncio.sleep(HOLD)
        gates.open_through(2)
        await _wait_for(lambda: tasks_out(4), 60)
        await asyncio.sleep(HOLD)
        gates.open_through(4)
        view = await stack.wait(job_id, timeout=120)
        tasks = await db.fetch("SELECT attempt, round FROM async_slots WHERE job_id = $1 ORDER BY attempt", job_id)
        folds = await db.fetch("SELECT version, staleness FROM async_folds WHERE job_id = $1 ORDER BY seq", job_id)

    # Assert: with a wait, both of version 2's tasks went out once version 1 was made (their round is the version
    # open when they went out), and no update was stale; without one (FedBuff), the first to report trained from
    # version 0 again (the second too, where its report came before the version), and version 2 folded stale
    # updates.
    assert view["status"] == "completed", view.get("reason")
    assert [(f["version"]) for f in folds] == [1, 1, 2, 2]
    if version_wait:
        assert [t["round"] for t in tasks] == [1, 1, 2, 2]
        assert [f["staleness"] for f in folds] == [0, 0, 0, 0]
    else:
        assert tasks[2]["round"] == 1
        assert [f["staleness"] for f in folds if f["version"] == 1] == [0, 0]
        assert max(f["staleness"] for f in folds if f["version"] == 2) == 1
