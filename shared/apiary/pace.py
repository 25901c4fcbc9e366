"""How often workers beat: a budget of heartbeats a second for the whole fleet.

Each worker beats every `heartbeat_interval` seconds (5 s deployed), so K workers send K / 5 beats a second, and
the scheduler and the tracker handle every one. A round at K = 1,000 lasts about ten times one at K = 100 and
pays that traffic for all of its length: the one cost that grew faster than K (README, Scale-out). So once the
fleet would send more than `presence_rate` beats a second, its interval is stretched by a factor, a power of
sqrt(2) (a fleet that grows one worker at a time changes it a few times, not at every join), and a worker is
offline after `worker_offline_after` times the same factor. The scheduler announces the factor (`presence.pace`
to every worker's control queue, and in each training assignment; `presence.pace.<worker id>` to one that joins
later or beats faster than the pace), each heartbeat says its worker's interval, and
services that judge presence go by the slowest pace heard within its own offline time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

STEP = math.sqrt(2.0)
MAX_FACTOR = 64.0  # a 5 s heartbeat is never stretched past 320 s


def pace_factor(workers: int, base_interval: float, presence_rate: float) -> float:
    """The factor (1, or a power of sqrt(2)) by which `workers` online stretch `base_interval`, so that they send
    at most `presence_rate` beats a second in all."""
    if workers < 0 or base_interval <= 0 or presence_rate <= 0:
        raise ValueError(f"pace of {workers} workers beating every {base_interval}s within {presence_rate}/s: "
                         "expected a count >= 0, a positive interval and a positive rate")
    needed = workers / (presence_rate * base_interval)
    if needed <= 1.0:
        return 1.0
    steps = math.ceil(math.log(needed, STEP) - 1e-9)
    return min(STEP**steps, MAX_FACTOR)


@dataclass
class PaceWindow:
    """The factor a service judges workers' presence by: the slowest heard (announced, decided, or reported by a
    worker's heartbeat) within one offline time at that factor. A worker still beating at a slower pace, not
    having heard the faster one, keeps the slower one in force; a restarted service learns it from the beats."""

    base_offline_after: float
    _heard: dict[float, float] = field(default_factory=dict)  # factor -> when last heard

    def hear(self, factor: float, now: float) -> None:
        """A pace was announced, decided or reported at `now`."""
        factor = min(max(factor, 1.0), MAX_FACTOR)
        if self._heard.get(factor, -math.inf) < now:
            self._heard[factor] = now

    def hear_interval(self, interval: object, base_interval: float, now: float) -> None:
        """A heartbeat said its worker beats every `interval` seconds (anything but a positive number: it said
        nothing, as beats from before apiary.pace)."""
        if isinstance(interval, int | float) and not isinstance(interval, bool) and math.isfinite(interval) \
                and interval > 0:
            self.hear(interval / base_interval, now)

    def in_force(self, now: float) -> float:
        """The factor presence is judged by at `now`."""
        live = [f for f, t in self._heard.items() if now - t <= self.base_offline_after * f]
        for f in [f for f in self._heard if f not in live]:
            del self._heard[f]
        return max(live, default=1.0)

    def offline_after(self, now: float) -> float:
        """Seconds without a beat after which a worker is offline, at `now`."""
        return self.base_offline_after * self.in_force(now)


__all__ = ["MAX_FACTOR", "STEP", "PaceWindow", "pace_factor"]
