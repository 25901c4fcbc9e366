"""Mode async: when a worker that reported waits for the version about to be made (services.scheduler.version_wait)."""

from __future__ import annotations

from services.scheduler.version_wait import Task, expected_duration, wait_for_version, waiters_shards

NOW = 100.0


def done(shard: int, worker: str, took: float, ended: float = NOW) -> Task:
    return Task(shard, worker, ended - took, ended)


def test_a_task_is_expected_to_take_as_long_as_the_slower_of_its_workers_and_its_shards_latest() -> None:
    history = [done(0, "w1", 1.0), done(3, "w2", 5.0), done(0, "w1", 3.0, ended=90.0)]  # newest first

    assert expected_duration(Task(0, "w1", NOW), history) == 1.0  # the latest, not the older 3 s
    assert expected_duration(Task(3, "w1", NOW), history) == 5.0  # a slow shard on a fast worker
    assert expected_duration(Task(1, "w2", NOW), history) == 5.0  # a slow worker on a new shard
    assert expected_duration(Task(1, None, NOW), history) is None  # a pool task of a shard not yet reported


def test_the_worker_whose_report_fills_the_buffer_waits_for_the_version() -> None:
    assert wait_for_version(NOW, took=2.0, fraction=0.5, buffer_size=4, folded=4, training=[], history=[]) == 1.0
    assert wait_for_version(NOW, took=2.0, fraction=0.5, buffer_size=4, folded=8, training=[], history=[]) == 1.0


def test_a_worker_waits_when_the_updates_the_buffer_lacks_are_due_within_half_its_wait() -> None:
    # Equal workers: the other three started with this one and take as long: due now.
    history = [done(s, f"w{s}", 1.0, ended=NOW - 1.0) for s in range(4)]
    training = [Task(s, f"w{s}", NOW - 1.0) for s in (1, 2, 3)]

    assert wait_for_version(NOW, 1.0, 0.5, 4, 1, training, history) == 0.5
    # One of the three is due 0.3 s from now: past half the wait (0.25 s), so no waiting, unless it is not needed.
    late = [*training[:2], Task(3, "w3", NOW - 0.7)]
    assert wait_for_version(NOW, 1.0, 0.5, 4, 1, late, history) is None
    assert wait_for_version(NOW, 1.0, 0.5, 4, 2, late, history) == 0.5  # two lacking: the two due now


def test_a_worker_never_waits_for_a_slow_one() -> None:
    # Shard 3 takes 5 s; the buffer lacks one update, and only the slow task is out.
    history = [done(0, "w0", 1.0), done(3, "w3", 5.0, ended=NOW - 5.0)]  # newest first
    training = [Task(3, "w3", NOW - 1.0)]

    assert wait_for_version(NOW, 1.0, 0.5, 2, 1, training, history) is None
    # With a fast task due as well, the worker waits for it (the buffer lacks one).
    assert wait_for_version(NOW, 1.0, 0.5, 2, 1, [*training, Task(1, "w1", NOW - 1.0)], history) == 0.5


def test_a_worker_does_not_wait_for_tasks_long_overdue_or_not_out() -> None:
    history = [done(1, "w1", 1.0, ended=NOW - 3.0)]
    overdue = [Task(1, "w1", NOW - 3.0)]  # due 2 s ago: hung, or much slower than it was

    assert wait_for_version(NOW, 1.0, 0.5, 2, 1, overdue, history) is None
    assert wait_for_version(NOW, 1.0, 0.5, 4, 1, [Task(1, "w1", NOW - 1.0)], history) is None  # lacks 3, 1 out


def test_without_a_history_the_reporters_own_time_stands_for_every_task() -> None:
    training = [Task(1, None, NOW - 2.0)]

    assert wait_for_version(NOW, 2.0, 0.5, 2, 1, training, []) == 1.0
    assert wait_for_version(NOW, 0.5, 0.5, 2, 1, training, []) is None  # it started 2 s ago, due 1.5 s ago


def test_a_version_wait_of_zero_is_fedbuff_the_next_task_at_once() -> None:
    assert wait_for_version(NOW, 1.0, 0.0, 4, 4, [], []) is None


def test_waiting_workers_get_their_own_shards_back_where_chosen() -> None:
    waiting = [("w2", 2), ("w0", 0), ("w9", 7), ("w5", 5)]

    assert waiters_shards([0, 1, 2, 3], waiting) == {2: "w2", 0: "w0", 1: "w9", 3: "w5"}
    assert waiters_shards([4], waiting) == {4: "w2"}  # more waiting than chosen: the longest waiting first
    assert waiters_shards([0, 1], []) == {}
