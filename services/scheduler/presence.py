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


__all__ = ["PresenceAction", "PresenceFilter"]
