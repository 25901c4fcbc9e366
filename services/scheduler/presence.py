"""Which worker presence reports the scheduler must act on. A worker beats every few seconds; with
a thousand workers that is hundreds of reports a second, and each used to cost a database write and a
look at every waiting job. Only two things matter to the scheduler: that a worker's `last_seen` stays
within `worker_offline_after` (so a row is written once it is 0.4 of that old: with the deployed heartbeat
of 5 s and offline after 20 s, every second beat is written, and a row is at most 8 s plus one beat old,
leaving 7 s for beats handled late), and that waiting jobs are looked at when a worker joins the online set
(it can start a round; a worker already in it cannot). A quarter (5 s) wrote nearly every beat: beats come
a little more than 5 s apart."""

from __future__ import annotations

from dataclasses import dataclass, field

from apiary.contracts import PresencePace
from apiary.pace import MAX_FACTOR, PaceWindow, pace_factor
from apiary.settings import Settings

REFRESH_FRACTION = 0.4  # of worker_offline_after: how stale this process lets a worker's last_seen get
FORGET_AFTER = 4096  # workers remembered; the least recently written goes first


@dataclass(frozen=True)
class PresenceAction:
    """What to do with one presence report."""

    write: bool  # store last_seen (and online/kind)
    joined: bool  # the worker (re)joins the online set: look at the waiting jobs


@dataclass
class PresenceFilter:
    """Per process: when each worker's presence was last written by this process."""

    offline_after: float
    written: dict[str, float] = field(default_factory=dict)

    def on_report(self, worker_id: str, online: bool, now: float, *, announced: bool = False) -> PresenceAction:
        """The action for a report at `now`; `announced` for worker.online (a kind may come with it)."""
        last = self.written.pop(worker_id, None)
        if not online:
            return PresenceAction(write=True, joined=False)
        if last is None:
            last = -float("inf")
        joined = announced or now - last >= self.offline_after
        stale = now - last >= self.offline_after * REFRESH_FRACTION
        if joined or stale:
            self.written[worker_id] = now
            while len(self.written) > FORGET_AFTER:
                del self.written[next(iter(self.written))]
            return PresenceAction(write=True, joined=joined)
        self.written[worker_id] = last
        return PresenceAction(write=False, joined=False)

    def forget(self, worker_id: str) -> None:
        """Acting on the worker's last report failed (the database away): its next report (the same one, retried)
        is written and joins again, as if never seen; else a write lost in an outage would keep a worker looking
        offline to the rounds it could start, and no join would ever look at the jobs waiting for it."""
        self.written.pop(worker_id, None)


@dataclass
class FleetPace:
    """The scheduler's side of apiary.pace: the factor its fleet's size calls for, announced when it changes,
    and the offline time presence is judged by (the slowest pace heard within its own offline time)."""

    base_interval: float
    base_offline_after: float
    presence_rate: float
    window: PaceWindow
    announced: float | None = None  # the factor this process announced last; None: none yet
    announcement: PresencePace | None = None  # what it announced last

    @classmethod
    def of(cls, settings: Settings) -> FleetPace:
        """The pace of the settings' heartbeat interval, offline time and presence rate."""
        return cls(settings.heartbeat_interval, settings.worker_offline_after, settings.presence_rate,
                   PaceWindow(settings.worker_offline_after))

    def counting_since(self, now: float) -> float:
        """Workers seen since then count as the fleet: before the first count, as far back as any pace reaches (a
        restarted scheduler must not take a slow-beating fleet for a small one)."""
        if self.announced is None:
            return now - self.base_offline_after * MAX_FACTOR
        return now - self.window.offline_after(now)

    def decide(self, workers: int, now: float) -> PresencePace | None:
        """The pace for `workers` online at `now`: the announcement to send if it differs from the last one."""
        factor = pace_factor(workers, self.base_interval, self.presence_rate)
        self.window.hear(factor, now)
        if factor == self.announced:
            return None
        self.announced = factor
        self.announcement = PresencePace(factor=factor, interval=self.base_interval * factor,
                                         offline_after=self.base_offline_after * factor, workers=workers)
        return self.announcement

    def heard_beat(self, interval: float | None, now: float) -> None:
        """A heartbeat said its worker beats every `interval` seconds."""
        self.window.hear_interval(interval, self.base_interval, now)

    @property
    def interval(self) -> float:
        """The heartbeat interval announced last (the base before any announcement)."""
        return self.base_interval * (self.announced or 1.0)

    @property
    def stretched(self) -> bool:
        """Whether the pace announced last is slower than the base interval."""
        return (self.announced or 1.0) > 1.0

    def offline_after(self, now: float) -> float:
        """Seconds without a beat after which a worker is offline, at `now`."""
        return self.window.offline_after(now)


@dataclass
class PaceReminders:
    """Which workers to tell the fleet's pace alone (`presence.pace.<id>`). An announcement reaches the workers
    online when the pace changes; one that joins later beats at its own interval until it takes an assignment
    (measured: 200 of 1,000 simulated workers that joined after the last change kept beating every 5 s, not 20 s,
    and the fleet sent 80-100 beats a second, not 50). So a worker that announces itself while the pace is
    stretched, or whose beat says a faster interval than the one announced, is told; again after one interval
    at that pace if its beats still say it did not hear (the reminder is not kept on disk)."""

    told: dict[str, float] = field(default_factory=dict)  # worker -> when last told

    def due(self, worker_id: str, beats_every: float | None, pace: FleetPace, now: float, *,
            announced: bool = False) -> bool:
        """Whether to tell the worker the pace now: it announced itself (`announced`), or beats every
        `beats_every` s (None: its beat did not say), while `pace` stretches the fleet's interval."""
        if not pace.stretched:
            self.told.clear()
            return False
        behind = announced or (beats_every is not None and beats_every < pace.interval * 0.99)
        if not behind:
            self.told.pop(worker_id, None)
            return False
        if not announced and now - self.told.get(worker_id, -float("inf")) < pace.interval:
            return False
        self.told.pop(worker_id, None)
        self.told[worker_id] = now
        while len(self.told) > FORGET_AFTER:
            del self.told[next(iter(self.told))]
        return True


__all__ = ["FleetPace", "PaceReminders", "PresenceAction", "PresenceFilter"]
