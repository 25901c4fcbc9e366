"""User code that raises, exits the process or hangs: a clear worker.failed or timeout record, the
round goes on with the other shards, and the worker stays up and trains again."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from tests.faults.support import Faults, assert_weights, expected_weights, new_id, toy_job

Record = Callable[[str, str, str, int], None]
Data = Callable[[int], Path]


def test_user_code_that_raises_exits_or_hangs_fails_its_shard_and_the_worker_stays_up(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=["site-a", "site-b"])
    pinned = ["site-a", "site-b"]
    timeout = 20  # the hung call's round: long enough for shard 0 to report from a busy machine
    jobs = {
        "raise": toy_job(new_id("raises"), toy_data(10), rounds=2, pinned=pinned,
                         config={"mode": "raise", "fail_shards": [1]}),
        "exit": toy_job(new_id("exits"), toy_data(10), rounds=2, pinned=pinned[::-1],
                        config={"mode": "exit", "fail_shards": [1]}),
        "hang": toy_job(new_id("hangs"), toy_data(10), rounds=1, pinned=pinned, timeout=timeout,
                        config={"mode": "hang", "fail_shards": [1]}),
    }
    errors = {
        "raise": "RuntimeError: toy failure on shard 1 (toy.py:",
        "exit": "user code exited the process (exit code 3)",
        # The worker gives the call what is left of the round when the call starts: the round's timeout, less
        # however long the assignment took to reach the child (more on a busy machine).
        "hang": "user code did not finish within ",
    }

    def stopped_within_the_round(text: str) -> bool:
        found = re.search(r"user code did not finish within (\d+)s and was stopped", text)
        return found is not None and 0 < int(found.group(1)) <= timeout

    # The hanging job first, so its healthy shard is at the head of site-a's queue (its deadline is short).
    cluster.publish_job(jobs["hang"])
    faults.wait_aggregation(jobs["hang"]["job_id"], 1, "open")
    cluster.publish_job(jobs["raise"])
    cluster.publish_job(jobs["exit"])
    ended = {mode: cluster.wait_job(request["job_id"]) for mode, request in jobs.items()}
    after = toy_job(new_id("after-failures"), toy_data(10), rounds=1, pinned=pinned)
    cluster.publish_job(after)
    sizes_after = faults.shard_sizes(after["job_id"])
    after_job = cluster.wait_job(after["job_id"])

    for mode, request in jobs.items():
        job_id = request["job_id"]
        assert ended[mode]["status"] == "completed", (mode, ended[mode]["reason"])
        rows = faults.contributions(job_id)
        rounds = request["distributed"]["num_rounds"]
        failed = [r for r in rows if r["shard"] == 1]
        if mode == "hang" and [r["status"] for r in failed] == ["late"]:
            # The worker stops the hung call at the round's deadline, when round.timeout fires too:
            # if the timeout closed the round first, the failure is recorded as late. Either way the
            # worker reported it, with the reason, and it is in the tracker's event log.
            reported = faults.query("SELECT body FROM events WHERE job_id = $1 AND routing_key = 'worker.failed'",
                                    job_id)
            assert len(reported) == 1 and stopped_within_the_round(reported[0]["body"]), reported
        else:
            assert [r["status"] for r in failed] == ["failed"] * rounds, (mode, rows)
            assert all(r["reason"].startswith(errors[mode]) for r in failed), (mode, [r["reason"] for r in failed])
            assert mode != "hang" or all(stopped_within_the_round(r["reason"]) for r in failed), failed
        assert [r["status"] for r in rows if r["shard"] == 0] == ["accepted"] * rounds, (mode, rows)
        sizes = faults.shard_sizes(job_id)
        line, double = faults.check_exact(job_id, [{0: sizes[0]}] * rounds)
        outcome(f"user code {mode}s (shard 1, pinned)",
                f"worker.failed '{errors[mode]}'; rounds aggregate shard 0; worker stays up",
                f"{ended[mode]['status']}; shard 1 {failed[0]['status']} in all {rounds} round(s):"
                f" {failed[0]['reason'][:60]!r};"
                f" {line}", double)
    hang = faults.aggregations(jobs["hang"]["job_id"])[0]
    assert hang["status"] == "aggregated" and hang["closed_at"] >= hang["deadline"]
    assert all(faults.alive().values()), faults.alive()
    assert after_job["status"] == "completed", after_job["reason"]
    assert_weights(faults.final_weights(after["job_id"]), expected_weights([sizes_after]))
    assert {r["worker_id"] for r in faults.contributions(after["job_id"]) if r["status"] == "accepted"} == set(pinned)
