"""The fleet's heartbeat pace (apiary.pace): the factor a fleet's size calls for, and the window services judge by."""

from __future__ import annotations

import math

import pytest

from apiary.pace import MAX_FACTOR, PaceWindow, pace_factor
from services.scheduler.presence import FleetPace, PaceReminders


def test_a_fleet_within_the_rate_beats_at_its_own_interval() -> None:
    # 250 workers beating every 5 s send 50 beats a second: within a rate of 50.
    assert pace_factor(0, 5.0, 50.0) == 1.0
    assert pace_factor(250, 5.0, 50.0) == 1.0


def test_a_larger_fleet_is_stretched_in_steps_of_root_two_to_keep_within_the_rate() -> None:
    # 1,000 workers at 5 s would send 200 a second: 4x slower keeps them at 50.
    assert pace_factor(1000, 5.0, 50.0) == pytest.approx(4.0)
    assert pace_factor(1001, 5.0, 50.0) == pytest.approx(4.0 * math.sqrt(2))
    for workers in (251, 400, 999, 1000, 5000, 16_000):  # 16,000: the ceiling, 64x
        factor = pace_factor(workers, 5.0, 50.0)
        assert workers / (5.0 * factor) <= 50.0 * (1 + 1e-9)  # within the rate
        assert workers / (5.0 * factor / math.sqrt(2)) > 50.0  # and one step faster would not be


def test_the_stretch_has_a_ceiling() -> None:
    assert pace_factor(10**9, 5.0, 50.0) == MAX_FACTOR


@pytest.mark.parametrize(("workers", "interval", "rate"), [(-1, 5.0, 50.0), (10, 0.0, 50.0), (10, 5.0, 0.0)])
def test_a_nonsense_pace_is_refused(workers: int, interval: float, rate: float) -> None:
    with pytest.raises(ValueError, match="expected a count >= 0"):
        pace_factor(workers, interval, rate)


def test_a_slower_pace_stays_in_force_for_its_own_offline_time_after_a_faster_one() -> None:
    window = PaceWindow(base_offline_after=20.0)
    window.hear(4.0, now=100.0)  # workers beat every 20 s, offline after 80 s
    window.hear(1.0, now=110.0)  # the fleet shrank: every 5 s, yet some may not have heard

    assert window.offline_after(150.0) == 80.0
    assert window.offline_after(180.0) == 80.0
    assert window.offline_after(181.0) == 20.0


def test_a_worker_still_beating_slowly_keeps_its_pace_in_force() -> None:
    window = PaceWindow(base_offline_after=20.0)
    window.hear(4.0, now=0.0)
    window.hear(1.0, now=1.0)
    window.hear_interval(20.0, base_interval=5.0, now=70.0)  # a beat of a worker that did not hear

    assert window.offline_after(140.0) == 80.0
    assert window.offline_after(151.0) == 20.0


def test_a_beat_that_says_no_interval_changes_nothing() -> None:
    window = PaceWindow(base_offline_after=20.0)
    for said in (None, "20", True, -5.0, 0.0, float("nan"), float("inf")):
        window.hear_interval(said, base_interval=5.0, now=1.0)
    assert window.offline_after(2.0) == 20.0


def test_the_scheduler_announces_a_pace_only_when_it_changes() -> None:
    pace = FleetPace(5.0, 20.0, 50.0, PaceWindow(20.0))

    first = pace.decide(10, now=0.0)
    again = pace.decide(12, now=5.0)
    grown = pace.decide(1000, now=10.0)
    same = pace.decide(990, now=15.0)

    assert first is not None and first.factor == 1.0 and first.interval == 5.0
    assert again is None and same is None
    assert grown is not None and (grown.factor, grown.interval, grown.offline_after, grown.workers) == (
        pytest.approx(4.0), pytest.approx(20.0), pytest.approx(80.0), 1000)
    assert pace.interval == pytest.approx(20.0)
    assert pace.offline_after(16.0) == pytest.approx(80.0)


def test_a_scheduler_that_never_counted_looks_as_far_back_as_any_pace_reaches() -> None:
    pace = FleetPace(5.0, 20.0, 50.0, PaceWindow(20.0))

    assert pace.counting_since(1000.0) == 1000.0 - 20.0 * MAX_FACTOR
    pace.decide(10, now=1000.0)
    assert pace.counting_since(1001.0) == 981.0


def test_a_worker_that_joins_or_beats_faster_than_a_stretched_pace_is_told_it_once_an_interval() -> None:
    pace = FleetPace(5.0, 20.0, 50.0, PaceWindow(20.0))
    reminders = PaceReminders()
    pace.decide(10, now=0.0)
    unstretched = reminders.due("w1", None, pace, 1.0, announced=True)
    pace.decide(1000, now=2.0)  # every 20 s

    joined = reminders.due("w1", None, pace, 3.0, announced=True)
    fast_again = reminders.due("w1", 5.0, pace, 8.0)  # it has not heard yet: told again after one interval
    fast_later = reminders.due("w1", 5.0, pace, 23.5)
    heard = reminders.due("w1", 20.0, pace, 43.5)
    silent = reminders.due("w2", None, pace, 44.0)  # a beat that says no interval
    other_fast = reminders.due("w2", 5.0, pace, 44.0)

    assert not unstretched
    assert joined and not fast_again and fast_later
    assert not heard and "w1" not in reminders.told
    assert not silent and other_fast
