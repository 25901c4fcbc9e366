"""The job state machine."""

from __future__ import annotations

from apiary.status import JobStatus
from services.scheduler.job_machine import Next, after_aggregated, after_failed, is_current, too_many_failures


def test_rounds_advance_until_the_last_then_finish() -> None:
    assert after_aggregated(1, 3).next is Next.NEXT_ROUND
    assert after_aggregated(2, 3).round == 3
    assert after_aggregated(3, 3).next is Next.FINISH


def test_failed_round_is_retried_until_fault_tolerance_is_exhausted() -> None:
    first = after_failed(2, 1, 0, fault_tolerance=1)
    second = after_failed(2, first.attempt, first.failures, fault_tolerance=1)

    assert (first.next, first.round, first.attempt, first.failures) == (Next.RETRY, 2, 2, 1)
    assert second.next is Next.FAIL and second.failures == 2


def test_zero_fault_tolerance_fails_on_the_first_failure() -> None:
    assert after_failed(1, 1, 0, fault_tolerance=0).next is Next.FAIL


def test_a_job_failed_by_its_rounds_says_which_how_often_and_the_last_reason() -> None:
    reason = too_many_failures(2, 3, fault_tolerance=2, last="timeout with 0 of 2 workers")

    assert reason == "round 2 failed 3 time(s) in a row (fault_tolerance=2); last: timeout with 0 of 2 workers"


def test_only_the_running_attempt_is_current() -> None:
    assert is_current(3, 2, 3, 2)
    assert not is_current(3, 2, 3, 1)
    assert not is_current(3, 2, 2, 2)


def test_terminal_states() -> None:
    assert {s for s in JobStatus if s.terminal} == {JobStatus.COMPLETED, JobStatus.FAILED,
                                                    JobStatus.CANCELLED, JobStatus.REJECTED}
