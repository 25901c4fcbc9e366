"""Mixed worker selection: a listed worker counts only when online with the kind the job lists it as."""

from __future__ import annotations

from services.scheduler.round_plan import usable_workers, waiting_for_workers

KINDS = {"1": "own", "3": "own", "5": "platform"}


def test_listed_workers_of_their_kind_count_and_others_are_named() -> None:
    online, wrong = usable_workers({"1": "own", "3": "platform", "5": "platform", "x": None}, KINDS)

    assert online == {"1", "5", "x"}
    assert wrong == {"3": "worker 3 is platform, listed as own"}


def test_a_worker_of_no_declared_kind_does_not_count_for_a_kind() -> None:
    _, wrong = usable_workers({"5": None}, KINDS)

    assert wrong == {"5": "worker 5 is of no declared kind, listed as platform"}


def test_pool_and_pinned_jobs_take_any_kind() -> None:
    assert usable_workers({"a": "own", "b": None}, {}) == ({"a", "b"}, {})


def test_the_waiting_reason_names_the_workers_of_the_wrong_kind() -> None:
    online, wrong = usable_workers({"1": "own", "3": "platform"}, KINDS)

    waiting = waiting_for_workers(2, list(KINDS), online, wrong)

    assert waiting is not None and (waiting.online, waiting.required) == (1, 2)
    assert waiting.reason.endswith("min_workers is 2; worker 3 is platform, listed as own")
    assert waiting_for_workers(1, list(KINDS), online, wrong) is None
