"""Which presence reports the scheduler writes and acts on (services/scheduler/presence.py)."""

from __future__ import annotations

from services.scheduler.presence import PresenceFilter


def test_a_new_worker_is_written_and_joins() -> None:
    presence = PresenceFilter(offline_after=20.0)
    action = presence.on_report("w1", True, 100.0)
    assert action.write and action.joined


def test_every_second_heartbeat_of_a_known_worker_is_written() -> None:
    presence = PresenceFilter(offline_after=20.0)
    presence.on_report("w1", True, 100.0, announced=True)
    # Beats a little more than 5 s apart (the deployed interval): every second one is written.
    beats = [presence.on_report("w1", True, t) for t in (105.1, 110.2, 115.3, 120.4, 125.5)]
    assert [(a.write, a.joined) for a in beats] == [
        (False, False), (True, False), (False, False), (True, False), (False, False)]


def test_a_worker_silent_past_the_offline_time_joins_again() -> None:
    presence = PresenceFilter(offline_after=20.0)
    presence.on_report("w1", True, 100.0)
    assert presence.on_report("w1", True, 121.0).joined


def test_going_offline_is_always_written_and_the_next_report_joins() -> None:
    presence = PresenceFilter(offline_after=20.0)
    presence.on_report("w1", True, 100.0)
    offline = presence.on_report("w1", False, 101.0)
    back = presence.on_report("w1", True, 102.0)
    assert offline.write and not offline.joined
    assert back.write and back.joined


def test_worker_online_always_joins() -> None:
    presence = PresenceFilter(offline_after=20.0)
    presence.on_report("w1", True, 100.0)
    again = presence.on_report("w1", True, 101.0, announced=True)
    assert again.write and again.joined


def test_a_report_whose_write_failed_is_written_and_joins_when_retried() -> None:
    # The database was away when the beat was to be written: nothing was stored, so the retried report must be
    # written (else the worker's row stays as old as the outage) and join (a job may have parked meanwhile).
    presence = PresenceFilter(offline_after=20.0)
    presence.on_report("w1", True, 100.0, announced=True)
    failed = presence.on_report("w1", True, 108.1)
    presence.forget("w1")
    retried = presence.on_report("w1", True, 109.0)
    assert failed.write and retried.write and retried.joined
