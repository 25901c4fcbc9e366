"""The one retry policy (apiary.backoff): jittered waits under a growing ceiling, bounded retries, polling."""

from __future__ import annotations

import asyncio

import pytest

from apiary.backoff import Backoff, poll, retry


def test_waits_are_spread_under_their_ceiling_so_failures_together_do_not_retry_together() -> None:
    # Prepare
    backoff = Backoff(base=0.25, cap=2.0)

    # Execute: what a thousand workers that failed three times each would wait.
    waits = [backoff.wait(3) for _ in range(1000)]

    # Assert: none past the ceiling, and spread over it rather than in lockstep.
    assert all(0.0 <= w <= backoff.delay(3) == 1.0 for w in waits)
    assert len(set(waits)) > 990
    assert min(waits) < 0.1 and max(waits) > 0.9


def test_a_retry_makes_its_attempts_then_raises_the_last_failure() -> None:
    # Prepare
    calls, told = 0, []

    def down() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError(f"refused {calls}")

    # Execute
    with pytest.raises(ConnectionError, match="refused 3"):
        retry(down, Backoff(attempts=3, base=0.001), lambda e: True,
              on_retry=lambda e, failures, wait: told.append(failures))

    # Assert
    assert calls == 3 and told == [1, 2]


def test_a_failure_that_is_not_retryable_is_raised_at_once() -> None:
    # Prepare
    calls = 0

    def broken() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("bad")

    # Execute / Assert
    with pytest.raises(ValueError):
        retry(broken, Backoff(attempts=5, base=0.001), lambda e: isinstance(e, ConnectionError))
    assert calls == 1


def test_a_retry_succeeds_once_the_call_does() -> None:
    # Prepare
    answers = iter([ConnectionError("once"), "ok"])

    def flaky() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    # Execute / Assert
    assert retry(flaky, Backoff(attempts=2, base=0.001), lambda e: True) == "ok"


async def test_a_poll_answers_true_as_soon_as_the_condition_holds() -> None:
    # Prepare: the condition holds on the third look.
    looks = 0

    async def stored() -> bool:
        nonlocal looks
        looks += 1
        return looks >= 3

    # Execute / Assert
    assert await poll(stored, Backoff(base=0.001, cap=0.002), timeout=10.0) is True
    assert looks == 3


async def test_a_poll_gives_up_at_its_timeout() -> None:
    # Prepare
    async def never() -> bool:
        return False

    # Execute
    loop = asyncio.get_running_loop()
    started = loop.time()
    answered = await poll(never, Backoff(base=0.01, cap=1.0), timeout=0.1)

    # Assert: no wait carried it far past the timeout.
    assert answered is False
    assert 0.1 <= loop.time() - started < 1.0
