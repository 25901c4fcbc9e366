"""Round rules under failure: duplicate and late results, quorum at the timeout, retries and
fault_tolerance, a worker that leaves mid-round and rejoins."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from pathlib import Path

from apiary import keys
from apiary.contracts import WorkerDone
from tests.faults.support import Faults, new_id, toy_job
from tests.toyjobs.toy import Gates

Record = Callable[[str, str, str, int], None]
Data = Callable[[int], Path]


def test_duplicated_and_late_worker_done_are_recorded_and_never_counted(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    cluster = faults.cluster
    cluster.start(workers=2)
    job_id = new_id("duplicate-late")
    reports = faults.tap("worker.done")
    # Shard 0 reports in a round only once the test opens that round's gate: round 1 stays open until the copy
    # has been judged, round 2 until the late reports have been.
    gates = str(tmp_path / "shard-0-may-report-in-round-{round}")

    def gate(round_index: int) -> Path:
        return Path(gates.replace("{round}", str(round_index)))

    cluster.publish_job(toy_job(job_id, toy_data(12), rounds=2,
                                config={"mode": "gated", "gate": gates, "fail_shards": [0]}))
    sizes = faults.shard_sizes(job_id)
    cluster.wait_for(lambda: faults.query(
        "SELECT * FROM contributions WHERE job_id = $1 AND round = 1 AND shard = 1 AND status = 'accepted'", job_id),
        60, "shard 1 of round 1 to be accepted")
    # The genuine message, secret and all, as a redelivery would bring it again.
    copy = next(m["body"] for m in faults.tapped(reports) if (m["round"], m["shard"]) == (1, 1))

    faults.publish("worker.done", copy)
    cluster.wait_for(lambda: faults.query(
        "SELECT 1 FROM contributions WHERE job_id = $1 AND round = 1 AND status = 'duplicate'", job_id), 30,
        "the copy to be recorded as a duplicate")
    open_then = faults.aggregations(job_id)[0]["status"]
    gate(1).touch()
    faults.wait_aggregation(job_id, 2, "open")
    faults.publish("worker.done", copy)
    skewed = {k: v + 1000 if v.is_floating_point() else v for k, v in faults.global_weights(job_id, 1).items()}
    forged = faults.put_weights(keys.contribution(job_id, 1, 1, 0) + ".late", skewed)
    faults.publish_event(WorkerDone(job_id=job_id, round=1, attempt=1, worker_id="worker-x", shard=0, result=forged,
                                    samples=1000))
    cluster.wait_for(lambda: len(faults.query(
        "SELECT 1 FROM contributions WHERE job_id = $1 AND status = 'late'", job_id)) == 2, 30,
        "both round-1 results sent during round 2 to be recorded as late")
    gate(2).touch()
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    assert open_then == "open"
    statuses = sorted((r["round"], r["shard"], r["status"], r["reason"] or "") for r in faults.contributions(job_id))
    assert statuses == [
        (1, 0, "accepted", ""), (1, 0, "late", "round already aggregated"),
        (1, 1, "accepted", ""), (1, 1, "duplicate", "shard 1 already reported (accepted)"),
        (1, 1, "late", "round already aggregated"),
        (2, 0, "accepted", ""), (2, 1, "accepted", ""),
    ]
    weights, double = faults.check_exact(job_id, [sizes, sizes])
    outcome("duplicated worker.done (copy while the round is open)", "recorded 'duplicate', not counted",
            f"recorded duplicate: {statuses[3][3]!r}; {weights}", double)
    outcome("late worker.done for round 1 during round 2 (a copy, and a forged one with 1000 samples)",
            "recorded 'late', not counted in round 1 or 2", f"both recorded late; {weights}", double)


def test_too_few_workers_by_the_timeout_fails_the_round_retries_then_fails_the_job(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=2)
    job_id = new_id("quorum")
    # Long enough for shard 0 to report on a busy machine (its worker starts a training child first): the
    # round's outcome, not the deadline's length, is what the case is about.
    timeout = 20
    cluster.publish_job(toy_job(job_id, toy_data(12), rounds=2, min_workers=2, timeout=timeout, fault_tolerance=1,
                                config={"mode": "slow", "slow_seconds": 600, "fail_shards": [1]}))
    sizes = faults.shard_sizes(job_id)

    job = cluster.wait_job(job_id, timeout=120)
    view, text = cluster.wait_for(lambda: (shown := faults.status_cli(job_id))[0]["status"] == "failed" and shown,
                                  30, "`apiary status` to show the job failed")

    # The straggler's worker stops it at the deadline too, so its worker.failed may come before or
    # after round.timeout: either way the round failed by timing out.
    last = "timeout: 1 of 2 shards contributed valid weights, min_workers is 2"
    # (The worker gives the call what is left of the round when the call starts: at most the timeout.)
    straggler = re.compile(r"; shard 1: user code did not finish within (\d+)s and was stopped")
    assert job["status"] == "failed"
    assert job["reason"].startswith(f"round 1 failed 2 time(s) in a row (fault_tolerance=1); last: {last}")
    rounds = [(r["round"], r["attempt"], r["status"]) for r in faults.rounds(job_id)]
    assert rounds == [(1, 1, "failed"), (1, 2, "failed")]
    for r in faults.rounds(job_id):
        said = straggler.fullmatch(r["reason"][len(last):]) if r["reason"].startswith(last) else None
        assert r["reason"] == last or (said and int(said.group(1)) <= timeout), r["reason"]
    assert [(a["attempt"], a["status"], a["closed_at"] >= a["deadline"]) for a in faults.aggregations(job_id)] == [
        (1, "failed", True), (2, "failed", True)]
    assert view["status"] == "failed" and view["reason"] == job["reason"]
    assert "reason:" in text and "fault_tolerance=1" in text
    assert faults.accepted(job_id) == {(1, 1): {0: sizes[0]}, (1, 2): {0: sizes[0]}}
    assert {r["status"] for r in faults.contributions(job_id) if r["shard"] == 1} <= {"failed", "late"}
    double = faults.double_counted(job_id)
    assert double == 0
    outcome("fewer than min_workers by the timeout (straggler shard, min_workers=2, fault_tolerance=1)",
            "round 1 fails 'timeout' with counts, retried once, then the job fails with the reason",
            f"rounds 1.1 and 1.2 failed {last[:60]!r}…; job failed; `apiary status` shows the reason", double)


def test_a_worker_that_leaves_mid_round_and_rejoins_gets_the_current_round_with_the_latest_weights(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    cluster = faults.cluster
    cluster.start(workers=["site-a", "site-b"])
    job_id = new_id("rejoin")
    gates = Gates(tmp_path)
    gates.open_through(3, first=2)  # shard 1 held in round 1 until site-b is stopped (it never reports round 1)
    # Round 1 closes at its deadline (site-b is stopped); round 2's must leave the restarted site-b time to start
    # its training child and report on a busy machine.
    cluster.publish_job(toy_job(job_id, toy_data(10), rounds=3, pinned=["site-a", "site-b"], timeout=24,
                                config={"mode": "gated", "gate": gates.path, "fail_shards": [1]}))
    sizes = faults.shard_sizes(job_id)
    faults.wait_training("site-b", job_id, 1)

    cluster.kill("site-b", signal.SIGTERM)
    first = faults.wait_aggregation(job_id, 1)
    cluster.start_worker("site-b")
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    assert first["closed_at"] >= first["deadline"]
    rows = sorted((r["round"], r["shard"], r["worker_id"], r["status"]) for r in faults.contributions(job_id))
    assert rows == [(1, 0, "site-a", "accepted"), (2, 0, "site-a", "accepted"), (2, 1, "site-b", "accepted"),
                    (3, 0, "site-a", "accepted"), (3, 1, "site-b", "accepted")]
    assert f"skipping stale assignment {job_id} round 1 shard 1" in cluster.log("site-b")
    weights, double = faults.check_exact(job_id, [{0: sizes[0]}, sizes, sizes])
    outcome("worker stops mid-round 1 (SIGTERM) and rejoins during round 2 (pinned)",
            "round 1 aggregates the others at the timeout; on rejoin the stale round-1 assignment is skipped"
            " and round 2 is trained from round 1's weights",
            f"round 1 from shard 0 at the timeout; site-b skipped round 1, trained rounds 2 and 3; {weights}", double)


def test_a_round_waits_for_min_workers_online_with_a_visible_reason(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=1)
    job_id = new_id("waiting")
    cluster.publish_job(toy_job(job_id, toy_data(8), rounds=2, min_workers=2, max_workers=2))
    waiting = cluster.wait_for(lambda: (j := cluster.job(job_id)) and j["status"] == "waiting" and j, 60,
                               "the job to wait for workers")
    view, _ = faults.status_cli(job_id)

    cluster.start_worker("worker-2")
    job = cluster.wait_job(job_id)

    assert waiting["reason"] == "waiting for workers: 1 online, min_workers is 2"
    assert view["status"] == "waiting" and view["reason"] == waiting["reason"]
    assert not faults.rounds(job_id) or faults.rounds(job_id)[0]["started_at"] > waiting["updated_at"]
    assert job["status"] == "completed", job["reason"]
    sizes = faults.shard_sizes(job_id)
    line, double = faults.check_exact(job_id, [sizes, sizes])
    outcome("fewer than min_workers online when a round should start",
            "the job waits, saying why, and starts when enough workers are online",
            f"waited ({waiting['reason']!r}), completed after worker-2 joined; {line}", double)
