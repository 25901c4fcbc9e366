"""Mode async: whether a worker that just reported waits for the version about to be made.

FedBuff hands a worker its next task at once, from the newest version. When that version is about to be
superseded (the worker's own report filled the buffer, or the buffer's last updates are due in a moment), the
next task trains from weights one version old for nothing: with equal workers every update is folded stale,
and a stale update counts for less ((1+s)^-a). So a worker waits for the next version when it is due soon,
at most `version_wait` times the time its own task took: a worker never waits for a slow one, whose update is
not due, and a version that does not come in that time (its updates came late, or were lost) is not waited for
longer. Pure timing logic: the scheduler feeds it its task table."""

from __future__ import annotations

from dataclasses import dataclass

HISTORY = 4  # reported tasks per slot looked at for the latest of each worker and shard


@dataclass(frozen=True)
class Task:
    """One training task's timing: its shard, the worker training it (None: any worker of the pool, not yet
    known), when it went out and, for one that reported, when."""

    shard: int
    worker: str | None
    issued_at: float
    ended_at: float | None = None

    @property
    def took(self) -> float:
        """How long a reported task took."""
        assert self.ended_at is not None
        return self.ended_at - self.issued_at


def expected_duration(task: Task, history: list[Task]) -> float | None:
    """How long `task` should take: as long as its worker's latest reported task or its shard's, whichever took
    longer (a slow worker and a big shard are both slow); None where neither has reported yet. The latest, not a
    median: a worker's first task (which started its training process) and a machine that got busier are forgotten
    after one task. `history`: reported tasks, newest first."""
    latest = [next((t.took for t in history if match(t)), None)
              for match in (lambda t: task.worker is not None and t.worker == task.worker,
                            lambda t: t.shard == task.shard)]
    known = [d for d in latest if d is not None]
    return max(known) if known else None


def wait_for_version(now: float, took: float, fraction: float, buffer_size: int, folded: int,
                     training: list[Task], history: list[Task]) -> float | None:
    """How long a worker whose task took `took` seconds and just reported waits for the next version, or None:
    its next task goes out now. `folded`: the reports since the open version started, this one included;
    `training`: the tasks still out; `history`: reported tasks, newest first.

    It waits (at most `fraction * took`) when its report filled the buffer, or when the updates the buffer still
    lacks are all due within half that time (the other half leaves the version time to be made): each task in
    training is due at its start plus its expected duration (`expected_duration`, else the latest reported
    task's, else `took`); one already later than the whole wait is not counted on."""
    window = fraction * took
    if window <= 0:
        return None
    lacking = (buffer_size - folded % buffer_size) % buffer_size
    if lacking == 0:
        return window
    typical = history[0].took if history else took
    due = sorted(t.issued_at + (expected_duration(t, history) or typical) for t in training)
    due = [d for d in due if d >= now - window]
    if len(due) < lacking:
        return None  # the version needs tasks that are not out yet (this worker's next one, say), or late ones
    return window if due[lacking - 1] <= now + window / 2 else None


def waiters_shards(chosen: list[int], waiting: list[tuple[str, int]]) -> dict[int, str]:
    """Which of the `chosen` shards goes to which waiting worker (`waiting`: each one's id and the shard it
    reported, longest waiting first): its own shard where that is chosen (its data is on its disk already), else
    the next chosen shard left."""
    given: dict[int, str] = {}
    for worker, shard in waiting:
        if shard in chosen and shard not in given:
            given[shard] = worker
    rest = [s for s in chosen if s not in given]
    others = [worker for worker, _ in waiting if worker not in given.values()]
    given.update(zip(rest, others, strict=False))
    return given
