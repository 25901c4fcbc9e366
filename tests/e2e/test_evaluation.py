"""Evaluation every round on workers, early stopping, and no user code in the control plane, through whole
jobs on the embedded stack."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from apiary import keys
from apiary.bus import publish_event
from apiary.contracts import WorkerEvaluated
from apiary.weights import loads
from tests.faults.support import process_alive
from tests.fixtures.embedded import StackFactory, toy_request
from tests.fixtures.processes import parent

# The variable naming tests.toyjobs.witness's file (that module is never imported here: its import is the
# side effect the test looks for).
WITNESS = "TOYJOB_WITNESS"


def read_witness(path: Path) -> list[dict[str, Any]]:
    """Every line the witness module left (none if it was never imported)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _weight_sum(data: bytes) -> float:
    return float(loads(data)["layer.weight"].sum())


async def test_no_user_code_runs_in_the_control_plane(embedded: StackFactory, toy_dataset: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a job module whose import and every call leave a line naming the process
    witness = tmp_path / "witness.jsonl"
    monkeypatch.setenv(WITNESS, str(witness))
    request = {**toy_request(toy_dataset, num_rounds=2), "entrypoint": "tests.toyjobs.witness:fl_train_model"}

    # Execute
    async with embedded(workers=2) as stack:
        view = await stack.wait(await stack.submit(request), timeout=120)

    # Assert: init, training and evaluation all ran, each only in a worker's training child
    records = read_witness(witness)
    assert view["status"] == "completed", view.get("reason")
    assert {r["event"] for r in records} == {"import", "init", "train", "evaluate"}, records
    # A training child's parent is this process's fork server (apiary.trainers.process), whose parent is this process.
    assert all(r["pid"] != os.getpid() and parent(r["ppid"]) == os.getpid() for r in records), records
    assert all(r["process"].startswith("apiary-worker-") for r in records), records
    assert "tests.toyjobs.witness" not in sys.modules


async def test_every_round_is_evaluated_on_a_worker_and_the_last_is_the_jobs(embedded: StackFactory,
                                                                             toy_dataset: Path) -> None:
    async with embedded(workers=2) as stack:
        job_id = await stack.submit(toy_request(toy_dataset, num_rounds=3))
        view = await stack.wait(job_id, timeout=120)
        sums = {r: _weight_sum(await stack.ports.storage.get_bytes(keys.global_weights(job_id, r))) for r in (1, 2, 3)}
        final = _weight_sum(await stack.ports.storage.get_bytes(keys.final_model(job_id)))
        report = json.loads(await stack.ports.storage.get_bytes(keys.final_metrics(job_id)))

    assert view["status"] == "completed", view.get("reason")
    evaluated = {r["round"]: r["evaluation"] for r in view["rounds"]}
    assert evaluated == {r: {"weight_sum": sums[r]} for r in (1, 2, 3)}
    assert view["metrics"]["weight_sum"] == final == sums[3]
    assert "loss" in view["metrics"]  # the last round's aggregated training metrics stay beside it
    assert [e["round"] for e in report["evaluations"]] == [1, 2, 3]


async def test_evaluate_every_0_evaluates_only_the_last_round(embedded: StackFactory, toy_dataset: Path) -> None:
    async with embedded(workers=2) as stack:
        view = await stack.wait(await stack.submit(toy_request(toy_dataset, num_rounds=3, evaluate_every=0)),
                                timeout=120)

    assert view["status"] == "completed", view.get("reason")
    assert [r["round"] for r in view["rounds"] if r["evaluation"]] == [3]


async def test_a_failed_evaluation_is_recorded_in_one_line_and_never_fails_the_round(
        embedded: StackFactory, toy_dataset: Path) -> None:
    request = {**toy_request(toy_dataset, num_rounds=3), "config": {"eval_mode": "raise", "eval_fail_rounds": [2]}}

    async with embedded(workers=2) as stack:
        view = await stack.wait(await stack.submit(request), timeout=120)

    assert view["status"] == "completed", view.get("reason")
    rounds = {r["round"]: r for r in view["rounds"]}
    assert all(r["status"] == "aggregated" for r in rounds.values())
    assert rounds[2]["evaluation"] is None
    assert re.fullmatch(r"RuntimeError: toy evaluation failure in round 2 \(toy.py:\d+ in fl_evaluate_model\)",
                        rounds[2]["evaluation_error"]), rounds[2]["evaluation_error"]
    assert rounds[3]["evaluation"] is not None and view["reason"] is None


async def test_early_stopping_ends_the_job_as_completed_keeping_the_best_round(embedded: StackFactory,
                                                                               toy_dataset: Path) -> None:
    # Prepare: the toy's weight_sum grows every round, so with mode min round 1 stays the best
    stopping = {"metric": "weight_sum", "mode": "min", "patience": 2}
    request = toy_request(toy_dataset, num_rounds=8, early_stopping=stopping)

    # Execute
    async with embedded(workers=2) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        final = await stack.ports.storage.get_bytes(keys.final_model(job_id))
        best = await stack.ports.storage.get_bytes(keys.global_weights(job_id, 1))

    # Assert
    assert view["status"] == "completed", view.get("reason")
    assert view["reason"] == "stopped early at round 3: weight_sum has not improved for 2 rounds"
    assert final == best
    assert view["metrics"]["weight_sum"] == _weight_sum(best)
    assert max(r["round"] for r in view["rounds"] if r["status"] == "aggregated") < 8


async def test_an_early_stopping_metric_the_evaluation_lacks_fails_the_job_in_one_line(
        embedded: StackFactory, toy_dataset: Path) -> None:
    request = toy_request(toy_dataset, num_rounds=4, early_stopping={"metric": "accuracy", "mode": "max"})

    async with embedded(workers=2) as stack:
        view = await stack.wait(await stack.submit(request), timeout=120)

    assert view["status"] == "failed"
    assert view["reason"] == ("early_stopping.metric 'accuracy' is not among round 1's metrics (weight_sum): "
                              "name one the job's rounds report")


async def test_a_second_report_of_an_evaluation_without_its_secret_is_refused_as_forged(
        embedded: StackFactory, toy_dataset: Path) -> None:
    async with embedded(workers=2) as stack:
        job_id = await stack.submit(toy_request(toy_dataset, num_rounds=2))
        before = await stack.wait(job_id, timeout=120)
        # A second report of round 1's evaluation, with other metrics, without the evaluate assignment's secret
        await publish_event(stack.ports.bus, WorkerEvaluated(job_id=job_id, round=1, worker_id="worker-2",
                                                             metrics={"weight_sum": -1.0}))
        await _until_events(stack, job_id, "report.forged", 1)
        after = await stack.wait(job_id, timeout=30)
        stored = await stack.ports.db.fetch("SELECT round, metrics FROM evaluations WHERE job_id = $1", job_id)
        announced = await stack.ports.db.fetchval(
            "SELECT COUNT(*) FROM events WHERE job_id = $1 AND routing_key = 'round.evaluated'", job_id)

    assert [r["evaluation"] for r in after["rounds"]] == [r["evaluation"] for r in before["rounds"]]
    assert after["metrics"] == before["metrics"]
    assert all(json.loads(r["metrics"])["weight_sum"] != -1.0 for r in stored)
    assert announced == 2  # one round.evaluated per round, from the genuine reports
    assert [(f["routing_key"], f["reason"]) for f in after["forged"]] == [
        ("worker.evaluated", "no assignment secret for the task")]


async def _until_events(stack: Any, job_id: str, key: str, count: int, timeout: float = 30) -> None:
    """Poll the tracker's event log until it holds `count` events of `key` for the job."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = await stack.ports.db.fetchval(
            "SELECT COUNT(*) FROM events WHERE job_id = $1 AND routing_key = $2", job_id, key)
        if seen >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{count} {key} events of job {job_id} not seen within {timeout}s")


async def test_cancelling_a_job_waiting_for_its_last_evaluation_stops_it_and_frees_the_worker(
        embedded: StackFactory, toy_dataset: Path) -> None:
    # Prepare: the only worker is 10 minutes into the last round's evaluation
    slow = {**toy_request(toy_dataset, num_rounds=1, min_workers=1, max_workers=1),
            "config": {"eval_mode": "slow", "eval_seconds": 600}}
    quick = toy_request(toy_dataset, num_rounds=1, min_workers=1, max_workers=1)
    async with embedded(workers=1) as stack:
        worker = stack.workers[0]
        slow_id = await stack.submit(slow)
        await _until(lambda: worker.slot.state == "evaluate", "the worker to evaluate")
        child = worker.runner.pid

        # Execute
        cancelled = await stack.cancel(slow_id, "cancelled by user")
        done = await stack.wait(await stack.submit(quick), timeout=120)
        reports = await stack.ports.db.fetchval(
            "SELECT COUNT(*) FROM events WHERE job_id = $1 AND routing_key = 'round.evaluated'", slow_id)

    # Assert: the job ended as cancelled, its evaluation's child was stopped and reported nothing, and the
    # worker ran the next job long before the evaluation would have ended
    assert cancelled is not None and cancelled["status"] == "cancelled"
    assert done["status"] == "completed", done.get("reason")
    assert child is not None and not process_alive(child)
    assert reports == 0


async def _until(check: Any, what: str, timeout: float = 60) -> None:
    """Poll `check()` until it is true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s")
        await asyncio.sleep(0.05)


async def test_a_module_without_fl_evaluate_model_is_judged_by_its_aggregated_metrics(
        embedded: StackFactory, toy_dataset: Path) -> None:
    # Prepare: the toy's loss falls every round, so with mode max round 1 stays the best
    request = {**toy_request(toy_dataset, num_rounds=6, early_stopping={"metric": "loss", "mode": "max",
                                                                          "patience": 1}),
               "entrypoint": "tests.toyjobs.noeval:fl_train_model"}

    # Execute
    async with embedded(workers=2) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        final = await stack.ports.storage.get_bytes(keys.final_model(job_id))
        best = await stack.ports.storage.get_bytes(keys.global_weights(job_id, 1))
        evaluations = await stack.ports.db.fetch("SELECT round, status FROM evaluations WHERE job_id = $1", job_id)

    # Assert: round 1's evaluate task found no function (a round aggregated before that was known may have
    # asked too), and early stopping read the aggregated loss
    assert view["status"] == "completed", view.get("reason")
    assert view["reason"] == "stopped early at round 2: loss has not improved for 1 round"
    assert final == best
    assert (1, "none") in [(e["round"], e["status"]) for e in evaluations]
    assert {e["status"] for e in evaluations} == {"none"}
    assert not any(r["evaluation"] for r in view["rounds"])
