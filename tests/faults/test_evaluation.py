"""A worker killed while it evaluates a round (deployed: RabbitMQ, PostgreSQL, S3): the evaluation goes back
to the pool, another worker runs it, and the round's evaluation is recorded once."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

from tests.faults.support import Faults, new_id, process_alive, toy_job

Record = Callable[[str, str, str, int], None]
Data = Callable[[int], Path]


def test_an_evaluation_whose_worker_is_killed_is_run_by_another_and_counted_once(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    # Prepare: round 1's evaluation takes a while
    cluster = faults.cluster
    cluster.start(workers=2)
    job_id = new_id("kill-eval")
    config = {"eval_mode": "slow", "eval_seconds": 4, "eval_fail_rounds": [1]}
    cluster.publish_job(toy_job(job_id, toy_data(8), rounds=2, config=config))
    evaluating = cluster.wait_for(lambda: faults.query(
        "SELECT worker_id FROM workers WHERE state = 'evaluate' AND job_id = $1 AND round = 1", job_id),
        60, "a worker to evaluate round 1")[0]["worker_id"]
    child = cluster.training_child(evaluating)
    assert child is not None

    # Execute: the evaluating worker alone, as `kill -9 PID` would
    cluster.kill(evaluating, signal.SIGKILL, group=False)
    cluster.wait_for(lambda: not process_alive(child), 10, f"the killed worker's child {child} to exit")
    job = cluster.wait_job(job_id)

    # Assert
    survivor = ({"worker-1", "worker-2"} - {evaluating}).pop()
    assert job["status"] == "completed", job["reason"]
    rows = faults.query("SELECT round, status, worker_id, metrics FROM evaluations WHERE job_id = $1 ORDER BY round",
                        job_id)
    assert [(r["round"], r["status"], r["worker_id"]) for r in rows] == [(1, "done", survivor), (2, "done", survivor)]
    assert "weight_sum" in json.loads(rows[0]["metrics"])
    reports = faults.query("SELECT COUNT(*) AS n FROM events WHERE job_id = $1 AND routing_key = 'round.evaluated'"
                           " AND round = 1", job_id)[0]["n"]
    assert reports == 1
    outcome("worker kill -9 mid-evaluation (pool)",
            "its evaluation rerun by another worker; recorded once; completed",
            f"{job['status']}; round 1 evaluated by {survivor}; {reports} round.evaluated for round 1", 0)
