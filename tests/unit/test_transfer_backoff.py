"""Transfers by URL wait longer after each transient failure, up to a cap (pure logic)."""

from __future__ import annotations

from apiary.transfer import Backoff


def test_the_wait_doubles_after_each_failure_up_to_the_cap() -> None:
    # Prepare
    backoff = Backoff(attempts=7, base=0.25, cap=2.0)

    # Execute
    waits = [backoff.delay(n) for n in range(1, backoff.attempts)]

    # Assert
    assert waits == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
