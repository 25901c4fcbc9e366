"""The aggregator's pure decisions: what a report is, when a round closes, why it fails."""

from __future__ import annotations

from apiary.status import ContributionStatus, RoundStatus
from apiary.strategies.format import UpdateFormat
from services.aggregator.decisions import (
    Verdict,
    all_settled,
    ended_status,
    failure_reason,
    judge_round,
    judge_shard,
    past_deadline,
    refusals,
    strategy_of,
    update_format,
)


def test_a_report_for_a_missing_round_is_an_orphan_and_for_a_closed_one_late() -> None:
    assert judge_round(None) == Verdict(ContributionStatus.ORPHAN, "no such round")
    assert judge_round({"status": "aggregated"}) == Verdict(ContributionStatus.LATE, "round already aggregated")
    assert judge_round({"status": "cancelled"}) == Verdict(ContributionStatus.LATE, "round already cancelled")
    assert judge_round({"status": "open"}) is None


def test_a_report_for_an_unassigned_or_settled_shard_settles_nothing() -> None:
    settled = {0: "accepted"}

    assert judge_shard(5, {0, 1}, settled) == Verdict(ContributionStatus.UNASSIGNED,
                                                      "shard 5 is not assigned in this round")
    assert judge_shard(0, {0, 1}, settled) == Verdict(ContributionStatus.DUPLICATE,
                                                      "shard 0 already reported (accepted)")
    assert judge_shard(1, {0, 1}, settled) is None


def test_a_round_closes_when_every_shard_settled_and_counts_as_timed_out_past_its_deadline() -> None:
    assert not all_settled({0}, {0, 1})
    assert all_settled({0, 1}, {0, 1})
    assert past_deadline(100.0, 100.0) and not past_deadline(100.0, 99.9)


def test_a_round_fails_below_min_workers_naming_each_refused_shard() -> None:
    rows = [{"shard": 0, "status": "accepted", "reason": None}, {"shard": 2, "status": "rejected", "reason": "NaN"},
            {"shard": 1, "status": "failed", "reason": None}, {"shard": 3, "status": "late", "reason": "x"}]
    refused = refusals(rows)

    assert refused == {"2": "NaN", "1": ""}
    assert failure_reason(1, 3, 1, refused, timed_out=False) is None
    assert failure_reason(1, 3, 2, refused, timed_out=True) == (
        "timeout: 1 of 3 shards contributed valid weights, min_workers is 2; shard 1: ; shard 2: NaN")
    assert failure_reason(0, 2, 1, {}, timed_out=False) == (
        "too few valid contributions: 0 of 2 shards contributed valid weights, min_workers is 1")


def test_a_round_s_format_and_strategy_are_read_from_its_row() -> None:
    assert update_format({"update_format": "adapter"}) is UpdateFormat.ADAPTER
    assert update_format({"update_format": "full"}) is UpdateFormat.FULL
    assert strategy_of({"strategy": "fedavg", "strategy_params": "{}"}) == ("fedavg", {})
    assert strategy_of({"strategy": "fedprox", "strategy_params": '{"proximal_mu": 0.1}'}) == (
        "fedprox", {"proximal_mu": 0.1})


def test_a_job_that_ends_closes_its_rounds_as_cancelled_or_failed() -> None:
    assert ended_status(cancelled=True) is RoundStatus.CANCELLED
    assert ended_status(cancelled=False) is RoundStatus.FAILED
