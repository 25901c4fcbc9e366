"""The aggregator's pure decisions: what a report is, when a round closes, and how it ends."""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from apiary import keys, proof
from apiary.component import from_json
from apiary.contracts import WorkerDone, WorkerFailed
from apiary.privacy import DifferentialPrivacy
from apiary.secagg.settings import SecureAggregation
from apiary.status import ContributionStatus, RoundStatus
from apiary.strategies.format import UpdateFormat

Report = WorkerDone | WorkerFailed


@dataclass(frozen=True)
class Verdict:
    """A report that settles nothing: what it is recorded as, and why."""

    status: ContributionStatus
    reason: str


def judge_round(aggregation: Mapping[str, Any] | None) -> Verdict | None:
    """A report for a round that never started here is an orphan, for a closed one late; else None."""
    if aggregation is None:
        return Verdict(ContributionStatus.ORPHAN, "no such round")
    if aggregation["status"] != RoundStatus.OPEN:
        return Verdict(ContributionStatus.LATE, f"round already {aggregation['status']}")
    return None


def judge_shard(shard: int, shards: Collection[int], settled: Mapping[int, str]) -> Verdict | None:
    """A report for a shard the round did not assign, or one already settled; else None (it counts)."""
    if shard not in shards:
        return Verdict(ContributionStatus.UNASSIGNED, f"shard {shard} is not assigned in this round")
    reported = settled.get(shard)
    if reported is not None:
        return Verdict(ContributionStatus.DUPLICATE, f"shard {shard} already reported ({reported})")
    return None


def judge_sender(report: Report, aggregation: Mapping[str, Any], user_id: str | None) -> Verdict | None:
    """A report that does not come from the worker its shard was assigned to is forged: it names another
    object than the shard's upload, lacks the assignment's secret or another worker's broker user sent it
    (apiary.proof.judge). Else None."""
    if isinstance(report, WorkerDone):
        expected = keys.contribution(report.job_id, report.round, report.attempt, report.shard)
        if report.result.key != expected:
            # Only the object the assignment's upload URL wrote counts: never any other in the bucket.
            return Verdict(ContributionStatus.FORGED,
                           f"result {report.result.key!r} is not this shard's upload ({expected!r})")
    digest = secret_digests(aggregation["secret_digests"]).get(str(report.shard), proof.UNMATCHABLE)
    reason = proof.judge(report.worker_id, user_id, report.secret, digest, about=f"shard {report.shard}")
    if reason is not None:
        return Verdict(ContributionStatus.FORGED, reason)
    return None


@functools.lru_cache(maxsize=64)
def secret_digests(stored: str) -> Mapping[str, str]:
    """A round's shard -> secret digest, from its row's JSON: parsed once per round, not once per report (the
    JSON holds every shard's digest, so parsing it for each report cost O(K) a report, O(K^2) a round). The same
    row text is one string object for the round's reports, whose hash Python computes once."""
    return from_json(stored)


def all_settled(settled: Collection[int], shards: Collection[int]) -> bool:
    """Whether every assigned shard has settled (accepted, rejected or failed): the round can close."""
    return len(settled) >= len(shards)


def past_deadline(deadline: float, now: float) -> bool:
    """Whether a round closing now closes as a timeout would (a straggler stopped at the deadline)."""
    return now >= deadline


def refusals(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Shard -> reason for each contribution refused or failed by the user's code."""
    unsettling = (ContributionStatus.REJECTED, ContributionStatus.FAILED)
    return {str(r["shard"]): r["reason"] or "" for r in rows if r["status"] in unsettling}


def failure_reason(accepted: int, expected: int, min_workers: int, refused: Mapping[str, str], *,
                   timed_out: bool) -> str | None:
    """Why a closing round fails (fewer valid contributions than min_workers), or None if it aggregates."""
    if accepted >= min_workers:
        return None
    why = "timeout" if timed_out else "too few valid contributions"
    reason = f"{why}: {accepted} of {expected} shards contributed valid weights, min_workers is {min_workers}"
    if refused:
        reason += "; " + "; ".join(f"shard {s}: {r}" for s, r in sorted(refused.items()))
    return reason


def update_format(aggregation: Mapping[str, Any]) -> UpdateFormat:
    """A round's update format."""
    return UpdateFormat(aggregation["update_format"])


def strategy_of(aggregation: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A round's strategy name and parameters."""
    return aggregation["strategy"], from_json(aggregation["strategy_params"])


def privacy_of(aggregation: Mapping[str, Any]) -> DifferentialPrivacy | None:
    """A round's differential privacy settings, if it has any."""
    stored = aggregation.get("privacy")
    return None if stored is None else DifferentialPrivacy.model_validate_json(stored)


@dataclass(frozen=True)
class SecureRoundSpec:
    """A round's secure aggregation as its row stores it: the job's settings and each shard's verify key."""

    settings: SecureAggregation
    verify_keys: Mapping[int, str]


def secure_of(aggregation: Mapping[str, Any]) -> SecureRoundSpec | None:
    """The round's secure aggregation, if it has one."""
    stored = aggregation.get("secagg")
    if stored is None:
        return None
    data = from_json(stored)
    return SecureRoundSpec(SecureAggregation.model_validate(data["settings"]),
                           {int(shard): key for shard, key in data["verify_keys"].items()})


def ended_status(cancelled: bool) -> RoundStatus:
    """How a job's open round ends when the job ends: cancelled, or failed."""
    return RoundStatus.CANCELLED if cancelled else RoundStatus.FAILED
