"""A secure round survives its aggregator's kill -9: the key agreement it had stored is replayed by the restarted
aggregator, which sends the current stage again; the round aggregates once, as an undisturbed one would."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import boto3
import torch

from apiary.bus.rabbitmq.broker import KEEP_RETURN
from apiary.secagg.settings import SecureAggregation
from apiary.weights import loads
from services.worker.host import left_aside
from tests.faults.support import Faults, new_id, toy_job
from tests.toyjobs.toy import Gates, noise_update

SECAGG = {"num_shares": 1, "reconstruction_threshold": 2}
WIDTH = 500


def test_aggregator_killed_during_the_key_agreement_resumes_the_secure_round(
        faults: Faults, toy_data: Callable[[int], Path], tmp_path: Path, s3_server: str,
        outcome: Callable[[str, str, str, int], None]) -> None:
    cluster = faults.cluster
    cluster.start(workers=3)
    job_id = new_id("kill-secagg")
    gate = tmp_path / "gate-{round}"
    request = toy_job(job_id, toy_data(13), rounds=1, min_workers=2, max_workers=3,
                      config={"mode": "gated", "gate": str(gate), "noise": 0.05, "width": WIDTH})
    request["distributed"]["secure_aggregation"] = SECAGG
    cluster.publish_job(request)
    # Every worker advertises its keys before training, which waits at the gate: the roster goes out meanwhile.
    cluster.wait_for(lambda: faults.query(
        "SELECT 1 FROM secagg_messages WHERE job_id = $1 AND round = 1 AND kind = 'stage.shares'", job_id),
        90, "the roster of round 1 to go out")

    cluster.kill("aggregator", signal.SIGKILL)
    cluster.start_service("aggregator")
    Path(str(gate).replace("{round}", "1")).write_text("open")
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    assert [(a["round"], a["status"]) for a in faults.aggregations(job_id)] == [(1, "aggregated")]
    rows = faults.query("SELECT shard, samples FROM contributions WHERE job_id = $1 AND status = 'accepted'"
                        " ORDER BY shard", job_id)
    assert [(r["shard"], r["samples"]) for r in rows] == [(0, 5), (1, 4), (2, 4)]
    bucket, _, prefix = cluster.storage_url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    final = loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/jobs/{job_id}/final/model.safetensors")["Body"].read())
    start = torch.zeros(WIDTH, dtype=torch.float64)
    expected = start + sum(n * (s + 1 + noise_update(1, s, "wide.weight", (WIDTH,), 0.05).double())
                           for s, n in ((0, 5), (1, 4), (2, 4))) / 13
    error = (final["wide.weight"].double() - expected).abs().max().item()
    assert error <= SecureAggregation(**SECAGG).resolved(3).error_bound(3, 13) + 1e-6
    outcome("aggregator kill -9 during a secure round's key agreement",
            "restarted aggregator replays the stored keys, resends the roster; the round aggregates once",
            f"{job['status']}; round 1 aggregated once; max error {error:.1e} within the quantisation bound", 0)


def publish_with_shard_2_held(faults: Faults, dataset: Path, gates: Gates, case: str,
                               pinned: list[str] | None = None) -> str:
    """Publish a one-round secure job of three shards whose shard 2 is held at the gate in training, and wait until
    shards 0 and 1, trained, have shared their keys (they wait for shard 2's shares); its job id."""
    job_id = new_id(case)
    request = toy_job(job_id, dataset, rounds=1, min_workers=2, max_workers=3, timeout=600, pinned=pinned,
                      config={"mode": "gated", "fail_shards": [2], "gate": gates.path, "noise": 0.05,
                              "width": WIDTH})
    request["distributed"]["secure_aggregation"] = SECAGG
    faults.cluster.publish_job(request)
    faults.cluster.wait_for(lambda: len(faults.query(
        "SELECT shard FROM secagg_messages WHERE job_id = $1 AND round = 1 AND kind = 'shares'", job_id)) == 2,
        90, "shards 0 and 1 to be trained and share their keys")
    return job_id


def error_from_shards_1_and_2(faults: Faults, job_id: str) -> float:
    """How far the job's final weights are from the plain mean of shards 1 and 2 (4 samples each), asserted within
    the secure round's quantisation bound."""
    expected = sum(n * (s + 1 + noise_update(1, s, "wide.weight", (WIDTH,), 0.05).double())
                   for s, n in ((1, 4), (2, 4))) / 8
    error = (faults.final_weights(job_id)["wide.weight"].double() - expected).abs().max().item()
    assert error <= SecureAggregation(**SECAGG).resolved(3).error_bound(2, 8) + 1e-6
    return error


def three_pool_workers_with_shard_2_held(faults: Faults, dataset: Path, tmp_path: Path,
                                        case: str) -> tuple[str, dict[int, str], Gates]:
    """Three workers take the job's three shards from the pool, one each, with shard 2's training held at a gate
    (`publish_with_shard_2_held`): the job, the worker that took each shard, and the gates."""
    faults.cluster.start(workers=3)
    gates = Gates(tmp_path, opened=0)
    job_id = publish_with_shard_2_held(faults, dataset, gates, case)
    holders = {r["shard"]: json.loads(r["body"])["worker_id"] for r in faults.query(
        "SELECT shard, body FROM secagg_messages WHERE job_id = $1 AND round = 1 AND kind = 'keys'", job_id)}
    assert len(set(holders.values())) == 3, f"the pool gave each worker one shard: {holders}"
    return job_id, holders, gates


def signal_and_wait_for_shard_0_failed(faults: Faults, job_id: str, worker: str, sig: int) -> float:
    """Send `sig` to `worker`'s processes; the seconds until round 1's shard 0 was recorded failed."""
    faults.cluster.kill(worker, sig)
    sent = time.monotonic()
    faults.cluster.wait_for(lambda: faults.query(
        "SELECT 1 FROM contributions WHERE job_id = $1 AND round = 1 AND shard = 0 AND status = 'failed'", job_id),
        90, "shard 0 to be reported failed")
    return time.monotonic() - sent


def test_a_worker_killed_while_its_trained_shard_waits_reports_it_failed_when_it_starts_again(
        faults: Faults, toy_data: Callable[[int], Path], tmp_path: Path,
        outcome: Callable[[str, str, str, int], None]) -> None:
    # Each worker trains its own shard; shard 2's training is held at a gate, so shards 0 and 1, trained, wait for
    # its shares. Then site-a (shard 0) is killed with SIGKILL and started again (a container's restart policy, an
    # out-of-memory kill): it finds shard 0's run in its folder and reports it failed, so the round is made from
    # shards 1 and 2 at once instead of waiting for the round's timeout (10 minutes here).
    cluster = faults.cluster
    sites = ["site-a", "site-b", "site-c"]
    cluster.start(workers=sites)
    gates = Gates(tmp_path, opened=0)
    job_id = publish_with_shard_2_held(faults, toy_data(13), gates, "kill-secagg-worker", pinned=sites)

    cluster.kill("site-a", signal.SIGKILL)
    killed = time.monotonic()
    cluster.start_worker("site-a")
    gates.open_through(1)
    job = faults.cluster.wait_job(job_id, timeout=120)
    took = time.monotonic() - killed

    assert job["status"] == "completed", job["reason"]
    rows = faults.query("SELECT shard, status, reason FROM contributions WHERE job_id = $1 ORDER BY shard", job_id)
    assert [(r["shard"], r["status"]) for r in rows] == [(0, "failed"), (1, "accepted"), (2, "accepted")]
    assert "the worker was killed before the shard was reported" in rows[0]["reason"]
    assert took < 120, f"the round waited {took:.0f} s: for its timeout, not for the restarted worker's report"
    error = error_from_shards_1_and_2(faults, job_id)
    assert left_aside(cluster.tmp / "home" / "workers" / "site-a") == []  # found, reported, removed
    outcome("worker kill -9 while its trained secure shard waits, then restarted",
            "the restarted worker reports the shard failed; the round is made from the others without its timeout",
            f"{job['status']} {took:.0f} s after the kill (timeout 600 s); shard 0 failed; max error {error:.1e}", 0)


def test_a_worker_killed_for_good_while_its_trained_shard_waits_is_reported_failed_by_another_worker(
        faults: Faults, toy_data: Callable[[int], Path], tmp_path: Path,
        outcome: Callable[[str, str, str, int], None]) -> None:
    # Three workers take round 1's three shards from the pool, one each; shard 2's training is held at a gate, so
    # shards 0 and 1, trained, wait for its shares, each kept from the broker by its worker. Then the worker of one
    # of them is killed with SIGKILL and never started again (a machine gone): the broker gives its assignment back
    # to the pool, the other trained shard's worker (its slot free) takes it and reports the shard failed, and the
    # round is made from the two others at once instead of waiting for its timeout (10 minutes here).
    job_id, holders, gates = three_pool_workers_with_shard_2_held(faults, toy_data(13), tmp_path,
                                                                  "lost-secagg-worker")
    lost, survivor = holders[0], holders[1]

    reported = signal_and_wait_for_shard_0_failed(faults, job_id, lost, signal.SIGKILL)
    killed = time.monotonic() - reported
    gates.open_through(1)
    job = faults.cluster.wait_job(job_id, timeout=120)
    took = time.monotonic() - killed

    assert job["status"] == "completed", job["reason"]
    rows = faults.query("SELECT shard, status, worker_id, reason FROM contributions WHERE job_id = $1 AND round = 1 "
                        "AND status <> 'duplicate' ORDER BY shard", job_id)
    assert [(r["shard"], r["status"]) for r in rows] == [(0, "failed"), (1, "accepted"), (2, "accepted")]
    assert rows[0]["worker_id"] == survivor, "the worker that took the assignment back reported it"
    assert "the worker that took the shard was lost" in rows[0]["reason"]
    error = error_from_shards_1_and_2(faults, job_id)
    outcome("worker kill -9 for good while its trained secure shard waits",
            "its kept assignment goes back to the pool; another worker reports the shard failed; the round goes on",
            f"{job['status']}; shard 0 reported failed {reported:.0f} s after the kill (timeout 600 s), job done "
            f"after {took:.0f} s; max error {error:.1e}", 0)


def test_a_worker_stopped_while_its_trained_shard_waits_reports_it_failed_once(
        faults: Faults, toy_data: Callable[[int], Path], tmp_path: Path,
        outcome: Callable[[str, str, str, int], None]) -> None:
    # As above, but the worker of shard 0 is stopped (SIGTERM: a deploy, a scale-down): it reports the shard failed
    # itself and lets its kept assignment go, so the broker gives nothing back: no other worker reports the shard a
    # second time once the kept copy's hold (10 s) would have expired.
    job_id, holders, gates = three_pool_workers_with_shard_2_held(faults, toy_data(13), tmp_path,
                                                                  "stopped-secagg-worker")
    stopped = holders[0]

    signal_and_wait_for_shard_0_failed(faults, job_id, stopped, signal.SIGTERM)
    time.sleep(KEEP_RETURN + 5)  # a kept copy left on a closed channel would be back in its queue by now
    reports = faults.query("SELECT worker_id, status, reason FROM contributions WHERE job_id = $1 AND round = 1"
                           " AND shard = 0", job_id)
    gates.open_through(1)
    job = faults.cluster.wait_job(job_id, timeout=120)

    assert job["status"] == "completed", job["reason"]
    assert [(r["worker_id"], r["status"]) for r in reports] == [(stopped, "failed")], reports
    assert "the worker stopped before the shard was reported" in reports[0]["reason"]
    error = error_from_shards_1_and_2(faults, job_id)
    outcome("worker stopped (SIGTERM) while its trained secure shard waits",
            "it reports the shard failed and lets its kept assignment go: no second report",
            f"{job['status']}; one report of shard 0, none in the {KEEP_RETURN + 5:.0f} s after; max error "
            f"{error:.1e}", 0)
