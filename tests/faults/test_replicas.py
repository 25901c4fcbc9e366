"""Services as replicas: two processes of each service consume the same queues. Each round must be
started once and aggregated once, each contribution counted once, the final weights exactly those of a
single-replica run (the toy's closed form), and the tracker's views complete, even when one replica of
the scheduler and of the aggregator is killed mid-round while the other goes on."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faults.support import Faults, new_id, toy_job
from tests.fixtures.cluster import SERVICES
from tests.toyjobs.toy import Gates

Record = Callable[[str, str, str, int], None]
Data = Callable[[int], Path]


def _start_with_replicas(faults: Faults, workers: int) -> None:
    faults.cluster.start(workers=workers)
    for name in SERVICES:
        faults.cluster.start_replica(name, 2)


def _assert_once_each(faults: Faults, job_id: str, rounds: int) -> dict[int, int]:
    sizes = faults.shard_sizes(job_id)
    assert [(r["round"], r["attempt"], r["status"]) for r in faults.rounds(job_id)] == [
        (i, 1, "aggregated") for i in range(1, rounds + 1)]
    assert faults.accepted(job_id) == {(i, 1): sizes for i in range(1, rounds + 1)}
    return sizes


@pytest.mark.queue_types
def test_two_replicas_of_each_service_run_two_jobs_exactly_once(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    # Six shards per round: each aggregator replica takes some of every round's reports
    _start_with_replicas(faults, workers=4)
    jobs = [new_id("replicas-a"), new_id("replicas-b")]
    for job_id in jobs:
        faults.cluster.publish_job(toy_job(job_id, toy_data(24), rounds=3, max_workers=6, timeout=300))

    ended = [faults.cluster.wait_job(job_id) for job_id in jobs]

    lines = []
    for job_id, job in zip(jobs, ended, strict=True):
        assert job["status"] == "completed", job["reason"]
        sizes = _assert_once_each(faults, job_id, 3)
        weights, _ = faults.check_exact(job_id, [sizes] * 3)
        # Closed once every shard reported, by whichever replica saw the last: not at the timeout
        assert all(a["closed_at"] < a["deadline"] for a in faults.aggregations(job_id))
        takers = {r["worker_id"] for r in faults.contributions(job_id)}
        assert len(sizes) == 6 and len(takers) >= 2
        view = faults.cluster.wait_for(lambda j=job_id: (v := faults.status_cli(j)[0])["status"] == "completed"
                                       and v, 60, "the tracker to show the job completed")
        assert [r["round"] for r in view["rounds"]] == [1, 2, 3]
        lines.append(weights)
    alive = faults.alive()
    assert all(alive[f"{name}-2"] for name in SERVICES)
    outcome("two replicas of every service, two jobs of 6 shards at once",
            "each round started and aggregated once, before its deadline; weights exact; tracker views complete",
            f"both completed; 3 rounds each, one attempt each; {lines[0]}", 0)


@pytest.mark.queue_types
def test_one_replica_killed_mid_round_while_the_other_goes_on(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    cluster = faults.cluster
    _start_with_replicas(faults, workers=2)
    job_id = new_id("replica-kill")
    gates = Gates(tmp_path, opened=1)  # round 2's shards held until the replicas are killed
    cluster.publish_job(toy_job(job_id, toy_data(12), rounds=3, config={"mode": "gated", "gate": gates.path}))
    faults.wait_training("worker-1", job_id, 2)

    cluster.kill("scheduler", signal.SIGKILL)
    cluster.kill("aggregator", signal.SIGKILL)
    at_kill = [(a["round"], a["status"]) for a in faults.aggregations(job_id)]
    gates.open_through(3, first=2)
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    assert (2, "aggregated") not in at_kill, "the kill came mid-round 2 (its shards held at their gates)"
    sizes = _assert_once_each(faults, job_id, 3)
    weights, double = faults.check_exact(job_id, [sizes] * 3)
    outcome("kill -9 of one scheduler and one aggregator replica mid-round 2",
            "the other replicas finish the job; each round started and aggregated once",
            f"{job['status']}; rounds 1-3 each one attempt; {weights}", double)
