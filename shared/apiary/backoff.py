"""The one retry policy: capped exponential backoff with full jitter, for every call that waits out a failure.

Each wait is a random part of its ceiling (`base` * 2^n s, at most `cap`), as botocore's standard retry mode
waits: a thousand workers that lost the broker together do not come back at the same instant, again and again.
Three ways to use it: `retry` (a blocking call, a bounded number of attempts or until a deadline),
`while_unavailable` (async work, for as long as a dependency stays away) and `poll` (async, until a condition
holds or a timeout passes).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from apiary import metrics
from apiary.errors import DependencyUnavailable

T = TypeVar("T")

# While the wait stays at its cap, a reminder this often (the growing intervals before it are each logged).
STILL_WAITING_EVERY = 60.0


@dataclass(frozen=True)
class Backoff:
    """How transient failures are retried: `attempts` in all, waiting up to `base` * 2^n s, at most `cap`."""

    attempts: int = 5
    base: float = 0.25
    cap: float = 8.0

    def delay(self, failures: int) -> float:
        """The longest wait after the `failures`-th failure in a row (1 for the first)."""
        return min(self.cap, self.base * 2 ** (failures - 1))

    def wait(self, failures: int) -> float:
        """The wait after the `failures`-th failure in a row: uniformly random up to `delay(failures)`."""
        return random.uniform(0.0, self.delay(failures))


def retry(call: Callable[[], T], backoff: Backoff, retryable: Callable[[BaseException], bool], *,
          deadline: float | None = None,
          on_retry: Callable[[BaseException, int, float], None] | None = None) -> T:
    """`call()`, run again after a jittered wait while it raises what `retryable` accepts: `backoff.attempts`
    times in all or, given a `deadline` (epoch seconds), for as long as a wait would end before it. The last
    failure is raised as it is; `on_retry(error, failures, wait)` is told of each wait before it starts."""
    failures = 0
    while True:
        try:
            return call()
        except Exception as e:
            failures += 1
            wait = backoff.wait(failures)
            spent = failures >= backoff.attempts if deadline is None else time.time() + wait >= deadline
            if spent or not retryable(e):
                raise
            if on_retry is not None:
                on_retry(e, failures, wait)
            time.sleep(wait)


async def while_unavailable(call: Callable[[], Awaitable[T]], backoff: Backoff, what: str,
                            logger: logging.Logger) -> T:
    """`call()`, run again after a growing wait (`backoff`, its attempts ignored) for as long as it raises
    DependencyUnavailable; one log line per growing interval, naming its ceiling. Cancelling it stops the wait."""
    loop = asyncio.get_running_loop()
    failures, started, logged = 0, loop.time(), -STILL_WAITING_EVERY
    while True:
        try:
            result = await call()
        except DependencyUnavailable as e:
            failures += 1
            metrics.dependency_retry(e.dependency)
            delay = backoff.delay(failures)
            now = loop.time()
            if delay > backoff.delay(failures - 1) or failures == 1 or now - logged >= STILL_WAITING_EVERY:
                logger.warning("%s: waiting for %s: %s; retrying in %g s", what, e.dependency, e.reason, delay)
                logged = now
            await asyncio.sleep(backoff.wait(failures))
            continue
        if failures:
            logger.info("%s: done after waiting %.1f s for a dependency", what, loop.time() - started)
        return result


async def poll(ready: Callable[[], Awaitable[bool]], backoff: Backoff, timeout: float) -> bool:
    """Ask `ready()` again after a growing, jittered wait (`backoff`, its attempts ignored) until it answers
    True or `timeout` seconds have passed; whether it did."""
    loop = asyncio.get_running_loop()
    deadline, failures = loop.time() + timeout, 0
    while not await ready():
        left = deadline - loop.time()
        if left <= 0:
            return False
        failures += 1
        await asyncio.sleep(min(backoff.wait(failures), left))
    return True


__all__ = ["Backoff", "poll", "retry", "while_unavailable"]
