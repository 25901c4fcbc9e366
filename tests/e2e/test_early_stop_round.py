"""Early stopping ends a job while its next round trains: that round is cancelled the way a cancel does it
(its workers stop at once, the aggregator closes it, nothing of it is aggregated), on the embedded stack."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.fixtures.embedded import StackFactory, toy_request


async def test_early_stopping_stops_the_round_already_training_and_aggregates_nothing_of_it(
        embedded: StackFactory, toy_dataset: Path) -> None:
    # Prepare: the toy's weight_sum grows every round, so with mode min and patience 1 round 2's evaluation
    # stops the job. Round 3 starts as soon as round 2 is aggregated (it does not wait for the evaluation)
    # and would train for 10 minutes on two workers; the third worker evaluates.
    stopping = {"metric": "weight_sum", "mode": "min", "patience": 1}
    request = {**toy_request(toy_dataset, num_rounds=5, min_workers=2, max_workers=2, early_stopping=stopping),
               "entrypoint": "tests.toyjobs.slowlater:fl_train_model", "config": {"slow_from": 3}}
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(request)

        # Execute
        await stack.wait(job_id, timeout=120)
        ended = time.monotonic()
        for _ in range(600):  # 30 s at most
            if all(w.slot.state == "idle" for w in stack.workers):
                break
            await asyncio.sleep(0.05)
        stopped_in = time.monotonic() - ended
        children = [w.runner.pid for w in stack.workers]
        aggregations = await stack.ports.db.fetch(
            "SELECT round, status, reason FROM aggregations WHERE job_id = $1 ORDER BY round", job_id)
        reports = await stack.ports.db.fetchval(
            "SELECT COUNT(*) FROM events WHERE job_id = $1 AND round = 3 AND routing_key IN "
            "('worker.done', 'worker.failed', 'round.aggregated')", job_id)
        held = stack.aggregator.rounds_in_memory()
        view = await stack.wait(job_id, timeout=1)  # the tracker has heard job.completed by now

    # Assert: completed by early stopping, keeping round 1; round 3 was running and is cancelled everywhere
    reason = "stopped early at round 2: weight_sum has not improved for 1 round"
    assert view["status"] == "completed", view.get("reason")
    assert view["reason"] == reason
    assert {r["round"]: r["status"] for r in view["rounds"]} == {1: "aggregated", 2: "aggregated", 3: "cancelled"}
    # Both of round 3's workers stopped training at once (not after their 10 minutes), their children ended.
    assert stopped_in < 30, [(w.worker_id, w.slot.state) for w in stack.workers]
    assert sum(pid is None for pid in children) >= 2, children
    # The aggregator heard the job end: round 3 closed as cancelled, with nothing reported or aggregated.
    assert [(a["round"], a["status"]) for a in aggregations] == [(1, "aggregated"), (2, "aggregated"),
                                                                  (3, "cancelled")]
    assert aggregations[2]["reason"] == f"job completed: {reason}"
    assert reports == 0
    assert not [r for r in held if r[0] == job_id]
