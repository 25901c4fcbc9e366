"""Processes killed with SIGKILL mid-job: workers, the aggregator, the scheduler, the sharder and the
tracker. Each is restarted (or not) and the job must end exactly as a run without the crash."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from apiary.strategies.base import Contribution, create
from apiary.strategies.format import UpdateFormat
from apiary.strategies.scaffold import control_deltas
from apiary.weights import loads as load_weights
from apiary.weights import spec_of_tensors
from tests.faults.support import (
    Faults,
    assert_weights,
    expected_weights,
    new_id,
    process_alive,
    replayed_weights,
    toy_job,
)
from tests.toyjobs.toy import Gates

Record = Callable[[str, str, str, int], None]
Data = Callable[[int], Path]


@pytest.mark.queue_types
def test_pool_assignment_of_a_killed_worker_is_trained_by_another(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    cluster = faults.cluster
    cluster.start(workers=2)
    job_id = new_id("kill-pool")
    gates = Gates(tmp_path)  # every shard held until worker-2 is gone
    cluster.publish_job(toy_job(job_id, toy_data(12), rounds=2, config={"mode": "gated", "gate": gates.path}))
    sizes = faults.shard_sizes(job_id)
    shard = faults.wait_training("worker-2", job_id, 1)
    child = cluster.training_child("worker-2")
    assert child is not None

    # The worker alone, as `kill -9 PID` would: nothing can stop its training child, which must
    # notice on its own and leave (an orphan would train on for nobody, holding its GPU's memory).
    cluster.kill("worker-2", signal.SIGKILL, group=False)
    cluster.wait_for(lambda: not process_alive(child), 10, f"the killed worker's training child {child} to exit")
    gates.open_through(2)
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    rows = faults.contributions(job_id)
    assert sorted((r["round"], r["shard"], r["worker_id"], r["status"]) for r in rows) == [
        (1, 0, "worker-1", "accepted"), (1, 1, "worker-1", "accepted"),
        (2, 0, "worker-1", "accepted"), (2, 1, "worker-1", "accepted"),
    ]
    weights, double = faults.check_exact(job_id, [sizes, sizes])
    outcome("worker kill -9 mid-training (pool)",
            "its training child exits; its shard retrained by another worker; completed; 2 full rounds",
            f"{job['status']}; orphaned child gone; round-1 shard {shard} accepted once, from worker-1; {weights}",
            double)


@pytest.mark.queue_types
def test_pinned_shard_waits_for_its_killed_worker_to_come_back(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    cluster = faults.cluster
    cluster.start(workers=["site-a", "site-b"])
    job_id = new_id("kill-pinned")
    gates = Gates(tmp_path)  # both shards held until site-b is gone
    cluster.publish_job(toy_job(job_id, toy_data(10), rounds=2, min_workers=2, pinned=["site-a", "site-b"],
                                config={"mode": "gated", "gate": gates.path}))
    sizes = faults.shard_sizes(job_id)
    faults.wait_training("site-b", job_id, 1)

    cluster.kill("site-b", signal.SIGKILL)
    gates.open_through(2)
    faults.wait_aggregation(job_id, 1, "open")
    cluster.wait_for(lambda: faults.query(
        "SELECT 1 FROM contributions WHERE job_id = $1 AND shard = 0 AND round = 1", job_id), 60,
        "site-a to report round 1")
    assert not faults.query("SELECT 1 FROM contributions WHERE job_id = $1 AND shard = 1", job_id)
    assert faults.aggregations(job_id)[0]["status"] == "open"
    cluster.start_worker("site-b")
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    rows = faults.contributions(job_id)
    assert sorted((r["round"], r["shard"], r["worker_id"], r["status"]) for r in rows) == [
        (1, 0, "site-a", "accepted"), (1, 1, "site-b", "accepted"),
        (2, 0, "site-a", "accepted"), (2, 1, "site-b", "accepted"),
    ]
    first = faults.aggregations(job_id)[0]
    assert first["status"] == "aggregated" and first["closed_at"] < first["deadline"]
    weights, double = faults.check_exact(job_id, [sizes, sizes])
    outcome("pinned worker kill -9, restarted before the deadline",
            "its shard waits for it (no other worker takes it); round completes before the timeout",
            f"{job['status']}; round 1 shard 1 trained by the restarted site-b, closed before the deadline;"
            f" {weights}", double)


@pytest.mark.queue_types
def test_aggregator_killed_after_contributions_were_recorded_resumes_without_double_counting(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    cluster = faults.cluster
    cluster.start(workers=2)
    job_id = new_id("kill-aggregator")
    gates = Gates(tmp_path)  # shard 0 held until the aggregator is down
    cluster.publish_job(toy_job(job_id, toy_data(15), rounds=2, max_workers=3,
                                config={"mode": "gated", "gate": gates.path, "fail_shards": [0]}))
    sizes = faults.shard_sizes(job_id)
    cluster.wait_for(lambda: len(faults.accepted(job_id).get((1, 1), {})) == 2, 60,
                     "two contributions of round 1 to be recorded")

    cluster.kill("aggregator", signal.SIGKILL)
    recorded = faults.accepted(job_id)[(1, 1)]
    gates.open_through(2)
    cluster.wait_for(lambda: faults.query(
        "SELECT 1 FROM shard_views WHERE job_id = $1 AND round = 1 AND shard = 0 AND state = 'reported'", job_id),
        60, "the last shard of round 1 to report while the aggregator is down")
    cluster.start_service("aggregator")
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    assert set(recorded) == {1, 2}
    assert faults.accepted(job_id) == {(1, 1): sizes, (2, 1): sizes}
    assert [(a["round"], a["status"]) for a in faults.aggregations(job_id)] == [(1, "aggregated"), (2, "aggregated")]
    weights, double = faults.check_exact(job_id, [sizes, sizes])
    outcome("aggregator kill -9 after 2 of 3 contributions recorded",
            "restarted aggregator rebuilds the sum from stored contributions; each round aggregated once",
            f"{job['status']}; rounds aggregated once each, 3 accepted rows per round; {weights}", double)


def test_aggregator_killed_mid_fedadam_job_ends_with_the_weights_of_an_undisturbed_run(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    cluster = faults.cluster
    cluster.start(workers=3)
    job_id = new_id("kill-aggregator-fedadam")
    gates = Gates(tmp_path, opened=1)  # shard 0 held in round 2 until the aggregator is back
    request = toy_job(job_id, toy_data(15), rounds=4, min_workers=3, max_workers=3,
                      config={"mode": "gated", "gate": gates.path, "fail_shards": [0]})
    request["distributed"]["strategy"] = "fedadam"
    cluster.publish_job(request)
    sizes = faults.shard_sizes(job_id)
    cluster.wait_for(lambda: faults.accepted(job_id).get((2, 1)), 120, "a contribution of round 2 to be recorded")

    cluster.kill("aggregator", signal.SIGKILL)
    recorded = sorted(faults.accepted(job_id)[(2, 1)])
    at_kill = faults.aggregations(job_id)[1]["status"]
    cluster.start_service("aggregator")
    gates.open_through(4)
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    assert at_kill == "open" and 0 not in recorded, "the kill came mid-round 2 (shard 0 held at its gate)"
    assert faults.accepted(job_id) == {(r, 1): sizes for r in (1, 2, 3, 4)}
    states = [a["state_key"] for a in faults.aggregations(job_id)]
    assert all(states), "every round stored FedAdam's moments"
    final, undisturbed = faults.final_weights(job_id), replayed_weights("fedadam", {}, faults.contributions(job_id))
    assert set(final) == set(undisturbed)
    assert all(torch.equal(final[name], undisturbed[name]) for name in final), (final, undisturbed)
    double = faults.double_counted(job_id)
    assert double == 0
    outcome("aggregator kill -9 mid-job of a FedAdam job (after a round-2 contribution was recorded)",
            "restarted aggregator reloads round 1's moments and re-folds round 2; final weights bit-identical",
            f"{job['status']}; shards {recorded} of round 2 recorded before the kill; 4 rounds aggregated once,"
            f" moments stored each round; final weights equal to an undisturbed run's", double)


def test_aggregator_killed_mid_scaffold_job_ends_as_an_undisturbed_fold_of_the_same_contributions(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    # Every round's contributions kept (finished rounds' are deleted otherwise): the replay reads them all.
    job_id, job, recorded = _scaffold_job_with_the_aggregator_killed_in_round_2(faults, toy_data, tmp_path,
                                                                              "kill-aggregator-scaffold",
                                                                              keep_contributions=True)

    assert job["status"] == "completed", job["reason"]
    assert 0 not in recorded, "the kill came mid-round 2 (shard 0 held at its gate)"
    rows = [r for r in faults.contributions(job_id) if r["status"] == "accepted"]
    assert sorted((r["round"], r["shard"]) for r in rows) == [(r, s) for r in (1, 2, 3) for s in (0, 1, 2)]
    # Replayed: each round's stored contributions through a fresh strategy, with their control deltas derived from
    # each shard's stored states (keep_contributions keeps every round's), as the aggregator derives them.
    kept = {(r["round"], r["shard"]): load_weights(faults.object(r["state_key"])) for r in faults.query(
        "SELECT round, shard, state_key FROM contribution_states WHERE job_id = $1", job_id)}
    weights, state, shard_states = faults.global_weights(job_id, 0), {}, {}
    for round_index in (1, 2, 3):
        strategy = create("scaffold")
        strategy.population(3)
        strategy.load_state(state)
        strategy.begin(spec_of_tensors(weights), UpdateFormat.FULL)
        for row in rows:
            if row["round"] == round_index:
                new = kept[(round_index, row["shard"])]
                deltas = control_deltas(new, shard_states.get(row["shard"], {}))
                shard_states[row["shard"]] = new
                strategy.accept(Contribution({**load_weights(faults.object(row["result_key"])), **deltas},
                                             row["samples"]))
        weights, state = strategy.finish(weights).weights, strategy.state()
    final = faults.final_weights(job_id)
    stored_c = load_weights(faults.object(faults.aggregations(job_id)[-1]["state_key"]))
    assert all(torch.equal(final[name], weights[name]) for name in final), (final, weights)
    assert set(stored_c) == set(state) and all(torch.equal(stored_c[k], state[k]) for k in state)
    assert any(bool(t.abs().max() > 0) for t in state.values())
    double = faults.double_counted(job_id)
    assert double == 0
    outcome("aggregator kill -9 mid-job of a SCAFFOLD job (after a round-2 contribution was recorded)",
            "restarted aggregator reloads round 1's control variate and re-folds round 2; final weights and c as "
            "an undisturbed fold", f"{job['status']}; shards {recorded} of round 2 recorded before the kill; final "
            "weights and stored control variate equal to a replay of the stored contributions", double)


def test_aggregator_killed_mid_scaffold_job_finds_the_shard_states_it_needs_while_superseded_ones_go(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    # Superseded shard states are deleted as rounds aggregate.
    job_id, job, _ = _scaffold_job_with_the_aggregator_killed_in_round_2(faults, toy_data, tmp_path,
                                                                       "kill-aggregator-scaffold-pruned",
                                                                       keep_contributions=False)

    assert job["status"] == "completed", job["reason"]
    rows = [r for r in faults.contributions(job_id) if r["status"] == "accepted"]
    assert sorted((r["round"], r["shard"]) for r in rows) == [(r, s) for r in (1, 2, 3) for s in (0, 1, 2)]
    # Every shard took part in every round, so c telescopes to the mean of the shards' final c_i: the restarted
    # aggregator derived each re-folded Δc_i from the states it needed (round 1's, still current then).
    finals = [load_weights(faults.object(f"jobs/{job_id}/final/shards/shard-{s:04d}.safetensors")) for s in range(3)]
    stored_c = load_weights(faults.object(faults.aggregations(job_id)[-1]["state_key"]))
    for name, c in stored_c.items():
        mean = sum(f["scaffold.c_i." + name.removeprefix("control.")] for f in finals) / 3
        assert torch.allclose(c, mean, rtol=0, atol=1e-6), name
    # What stays of the shards' states is each one's current copy.
    current = {r["state_key"] for r in faults.query("SELECT state_key FROM shard_states WHERE job_id = $1", job_id)}
    listed = faults.s3.list_objects_v2(Bucket=faults.bucket, Prefix=f"{faults.prefix}/jobs/{job_id}/shard-state/")
    assert {o["Key"].removeprefix(f"{faults.prefix}/") for o in listed.get("Contents", [])} == current
    double = faults.double_counted(job_id)
    assert double == 0
    outcome("aggregator kill -9 mid-job of a SCAFFOLD job, superseded shard states deleted",
            "restarted aggregator re-derives round 2's control deltas from the shards' current states",
            f"{job['status']}; c equal to the mean of the shards' final c_i; only the current states stored", double)


def _scaffold_job_with_the_aggregator_killed_in_round_2(faults: Faults, toy_data: Data, tmp_path: Path, name: str,
                                                        *, keep_contributions: bool) -> tuple[str, dict[str, Any],
                                                                                              list[int]]:
    """A 3-round SCAFFOLD job on 3 workers (shard 0 held in round 2 until the aggregator is back) whose aggregator is
    killed with SIGKILL once a round-2 contribution is recorded, then restarted: the job id, the job as it ended, and
    the shards recorded at the kill."""
    cluster = faults.cluster
    cluster.start(workers=3)
    job_id = new_id(name)
    gates = Gates(tmp_path, opened=1)
    request = toy_job(job_id, toy_data(15), rounds=3, min_workers=3, max_workers=3,
                      config={"mode": "gated", "gate": gates.path, "fail_shards": [0]})
    request["entrypoint"] = "tests.toyjobs.scaffoldtoy:fl_train_model"
    request["distributed"]["strategy"] = "scaffold"
    if keep_contributions:
        request["distributed"]["transfer"] = {"keep_contributions": True}
    cluster.publish_job(request)
    cluster.wait_for(lambda: faults.accepted(job_id).get((2, 1)), 120, "a contribution of round 2 to be recorded")

    cluster.kill("aggregator", signal.SIGKILL)
    recorded = sorted(faults.accepted(job_id)[(2, 1)])
    cluster.start_service("aggregator")
    gates.open_through(3)
    return job_id, cluster.wait_job(job_id), recorded


def test_scheduler_killed_between_rounds_and_mid_round_resumes_the_job(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    cluster = faults.cluster
    cluster.start(workers=2)
    job_id = new_id("kill-scheduler")
    # Each round's shards are held until the test has killed the scheduler in it (the tracker shows a shard
    # training from the worker's next beat and its batched write, a second or two).
    gates = Gates(tmp_path)
    cluster.publish_job(toy_job(job_id, toy_data(12), rounds=3, config={"mode": "gated", "gate": gates.path}))
    sizes = faults.shard_sizes(job_id)
    faults.wait_training("worker-1", job_id, 1)

    cluster.kill("scheduler", signal.SIGKILL)
    gates.open_through(1)
    faults.wait_aggregation(job_id, 1)
    between = [(r["round"], r["status"]) for r in faults.rounds(job_id)]
    cluster.start_service("scheduler")
    faults.wait_training("worker-1", job_id, 2)
    cluster.kill("scheduler", signal.SIGKILL)
    cluster.start_service("scheduler")
    gates.open_through(3, first=2)
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    assert between == [(1, "running")]
    assert [(r["round"], r["attempt"], r["status"]) for r in faults.rounds(job_id)] == [
        (1, 1, "aggregated"), (2, 1, "aggregated"), (3, 1, "aggregated")]
    assert faults.accepted(job_id) == {(1, 1): sizes, (2, 1): sizes, (3, 1): sizes}
    weights, double = faults.check_exact(job_id, [sizes] * 3)
    outcome("scheduler kill -9 between rounds 1 and 2, and mid-round 2",
            "restarted scheduler resumes from its tables; each round started and aggregated once",
            f"{job['status']}; rounds 1-3 each one attempt, aggregated; {weights}", double)


def test_sharder_and_tracker_killed_and_restarted_lose_nothing(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    cluster = faults.cluster
    cluster.start(workers=2)
    cluster.kill("sharder", signal.SIGKILL)
    job_id = new_id("kill-sharder-tracker")

    # The shards are held until the tracker has shown round 1 training and been killed.
    gates = Gates(tmp_path)
    cluster.publish_job(toy_job(job_id, toy_data(12), rounds=2, config={"mode": "gated", "gate": gates.path}))
    cluster.wait_for(lambda: (j := cluster.job(job_id)) and j["status"] == "sharding", 60, "the job to be accepted")
    cluster.start_service("sharder")
    sizes = faults.shard_sizes(job_id)
    faults.wait_training("worker-1", job_id, 1)
    cluster.kill("tracker", signal.SIGKILL)
    gates.open_through(2)
    faults.wait_aggregation(job_id, 1)
    cluster.start_service("tracker")
    job = cluster.wait_job(job_id)
    view = cluster.wait_for(lambda: (v := faults.status_cli(job_id)[0])["status"] == "completed" and v, 60,
                            "the tracker to show the job completed")

    assert job["status"] == "completed", job["reason"]
    assert [(r["round"], r["status"]) for r in view["rounds"]] == [(1, "aggregated"), (2, "aggregated")]
    weights, double = faults.check_exact(job_id, [sizes, sizes])
    outcome("sharder down at submission, tracker kill -9 mid-round",
            "sharding waits for the restarted sharder; the restarted tracker catches up",
            f"{job['status']}; `apiary status` shows both rounds aggregated; {weights}", double)


FAIL_ONCE = """
CREATE FUNCTION apiary_fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  -- nextval is not rolled back with the failed transaction: only the first write fails.
  IF nextval(TG_ARGV[0]) = 1 THEN
    RAISE EXCEPTION 'injected fault: %', TG_ARGV[0];
  END IF;
  RETURN NEW;
END $$
"""


def test_aggregator_writes_failing_once_neither_lose_nor_double_count_a_contribution(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=2)
    for statement in (
        "CREATE SEQUENCE fault_accept", "CREATE SEQUENCE fault_close", FAIL_ONCE,
        # Recording round 1's contribution of shard 1 fails once (after it was folded into the sum) ...
        "CREATE TRIGGER fail_accept BEFORE INSERT ON contributions FOR EACH ROW"
        " WHEN (NEW.status = 'accepted' AND NEW.round = 1 AND NEW.shard = 1)"
        " EXECUTE FUNCTION apiary_fail_once('fault_accept')",
        # ... and closing round 2 fails once (after the average was computed and stored).
        "CREATE TRIGGER fail_close BEFORE UPDATE ON aggregations FOR EACH ROW"
        " WHEN (NEW.status = 'aggregated' AND NEW.round = 2) EXECUTE FUNCTION apiary_fail_once('fault_close')",
    ):
        faults.query(statement)
    job_id = new_id("aggregator-db-fault")

    cluster.publish_job(toy_job(job_id, toy_data(12), rounds=3, timeout=60))
    sizes = faults.shard_sizes(job_id)
    job = cluster.wait_job(job_id, timeout=100)

    assert job["status"] == "completed", job["reason"]
    assert [faults.query(f"SELECT last_value FROM {s}")[0]["last_value"] for s in ("fault_accept", "fault_close")] \
        == [2, 2], "each fault fired once and the write then succeeded"
    closing = [(a["round"], a["status"], a["closed_at"] < a["deadline"]) for a in faults.aggregations(job_id)]
    assert closing == [(1, "aggregated", True), (2, "aggregated", True), (3, "aggregated", True)]
    assert faults.accepted(job_id) == {(1, 1): sizes, (2, 1): sizes, (3, 1): sizes}
    assert_weights(faults.global_weights(job_id, 2), expected_weights([sizes, sizes]))
    weights, double = faults.check_exact(job_id, [sizes] * 3)
    outcome("aggregator's database write fails once: recording a contribution, then closing a round",
            "the redelivered worker.done is folded once / closes the round at once, with the right average",
            f"{job['status']}; every round closed before its deadline; {weights}", double)
