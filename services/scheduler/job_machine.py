"""The job state machine as pure functions: what happens after each round outcome."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Next(enum.Enum):
    """The scheduler's move after a round ends."""

    NEXT_ROUND = "next_round"
    FINISH = "finish"
    RETRY = "retry"
    FAIL = "fail"


@dataclass(frozen=True)
class Decision:
    """A move, with the round and attempt it starts (if any) and the failure count after it."""

    next: Next
    round: int
    attempt: int
    failures: int


def after_aggregated(round_index: int, num_rounds: int) -> Decision:
    """A round succeeded: start the next one or finish the job."""
    if round_index >= num_rounds:
        return Decision(Next.FINISH, round_index, 0, 0)
    return Decision(Next.NEXT_ROUND, round_index + 1, 1, 0)


def after_failed(round_index: int, attempt: int, failures: int, fault_tolerance: int) -> Decision:
    """A round failed: retry it from the last global weights, or fail the job after too many in a row."""
    failures += 1
    if failures > fault_tolerance:
        return Decision(Next.FAIL, round_index, attempt, failures)
    return Decision(Next.RETRY, round_index, attempt + 1, failures)


def too_many_failures(round_index: int, failures: int, fault_tolerance: int, last: str) -> str:
    """Why a job failed when its round failed more times in a row than it tolerates."""
    return (f"round {round_index} failed {failures} time(s) in a row "
            f"(fault_tolerance={fault_tolerance}); last: {last}")


def is_current(job_round: int, job_attempt: int, round_index: int, attempt: int) -> bool:
    """Whether an outcome is for the attempt the job is running now (else it is late or a duplicate)."""
    return (job_round, job_attempt) == (round_index, attempt)
