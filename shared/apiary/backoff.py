"""Capped exponential backoff, and running a call again for as long as a dependency stays away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from apiary.errors import DependencyUnavailable

T = TypeVar("T")

# While the wait stays at its cap, a reminder this often (the growing intervals before it are each logged).
STILL_WAITING_EVERY = 60.0


@dataclass(frozen=True)
class Backoff:
    """How transient failures are retried: `attempts` in all, waiting `base` * 2^n s, at most `cap`."""

    attempts: int = 5
    base: float = 0.25
    cap: float = 8.0

    def delay(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th failure in a row (1 for the first)."""
        return min(self.cap, self.base * 2 ** (failures - 1))


async def while_unavailable(call: Callable[[], Awaitable[T]], backoff: Backoff, what: str,
                            logger: logging.Logger) -> T:
    """`call()`, run again after a growing wait (`backoff`, its attempts ignored) for as long as it raises
    DependencyUnavailable; one log line per growing interval. Cancelling it stops the wait."""
    loop = asyncio.get_running_loop()
    failures, started, logged = 0, loop.time(), -STILL_WAITING_EVERY
    while True:
        try:
            result = await call()
        except DependencyUnavailable as e:
            failures += 1
            delay = backoff.delay(failures)
            now = loop.time()
            if delay > backoff.delay(failures - 1) or failures == 1 or now - logged >= STILL_WAITING_EVERY:
                logger.warning("%s: waiting for %s: %s; retrying in %g s", what, e.dependency, e.reason, delay)
                logged = now
            await asyncio.sleep(delay)
            continue
        if failures:
            logger.info("%s: done after waiting %.1f s for a dependency", what, loop.time() - started)
        return result
