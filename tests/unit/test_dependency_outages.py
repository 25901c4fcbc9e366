"""Which failures are a dependency being away (issue 22), what the bus decides for them, and how long
work waits between tries: pure logic, no server."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from apiary import transfer
from apiary.backoff import Backoff, while_unavailable
from apiary.bus.base import BrokerUnavailable, Outcome, Retryable, Unroutable, decide
from apiary.bus.memory import MemoryBus
from apiary.contracts import DecodeError
from apiary.db.base import DatabaseUnavailable
from apiary.errors import DependencyUnavailable
from apiary.settings import Settings
from apiary.storage.base import StorageUnavailable
from apiary.storage.s3 import transient


def _client_error(code: str, status: int) -> ClientError:
    response: Any = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "GetObject")


# --- The decision ------------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [
    DatabaseUnavailable("the database system is shutting down"),
    StorageUnavailable("503 SlowDown"),
    BrokerUnavailable("connection lost"),
])
def test_a_dependency_outage_is_never_dead_lettered_however_often_it_is_delivered(error: Exception) -> None:
    # Execute
    first, again = decide(error, redelivered=False), decide(error, redelivered=True)

    # Assert
    assert first[0] is again[0] is Outcome.REQUEUE


def test_what_can_never_succeed_is_still_dead_lettered() -> None:
    # Execute / Assert
    assert decide(DecodeError("not msgpack"), redelivered=False)[0] is Outcome.DEAD
    assert decide(RuntimeError("bug"), redelivered=True)[0] is Outcome.DEAD
    assert decide(Retryable("later"), redelivered=True)[0] is Outcome.REQUEUE


def test_every_adapters_outage_is_one_kind_and_unroutable_is_not_one() -> None:
    # Assert
    for kind in (DatabaseUnavailable, StorageUnavailable, BrokerUnavailable):
        assert issubclass(kind, DependencyUnavailable)
    assert not issubclass(Unroutable, DependencyUnavailable)


# --- The broker's publish --------------------------------------------------------------------------


class _BrokerGone(MemoryBus):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def _publish(self, message: object, delay: float | None) -> None:
        raise self.error


async def test_a_publish_the_broker_cannot_take_is_broker_unavailable() -> None:
    # Prepare
    bus = _BrokerGone(ConnectionResetError("connection reset by peer"))

    # Execute
    with pytest.raises(BrokerUnavailable) as raised:
        await bus.publish("worker.done", b"x")

    # Assert
    assert raised.value.reason == "connection reset by peer"
    assert isinstance(raised.value.__cause__, ConnectionResetError)


async def test_unroutable_and_other_publish_failures_keep_their_type() -> None:
    # Execute / Assert
    with pytest.raises(Unroutable):
        await _BrokerGone(Unroutable("no queue")).publish("worker.done", b"x")
    with pytest.raises(ValueError):
        await _BrokerGone(ValueError("bad header")).publish("worker.done", b"x")


# --- S3's answers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("error", "expected"), [
    (EndpointConnectionError(endpoint_url="http://s3"), True),
    (ReadTimeoutError(endpoint_url="http://s3"), True),
    (_client_error("SlowDown", 503), True),
    (_client_error("InternalError", 500), True),
    (_client_error("RequestTimeout", 400), True),
    (_client_error("Throttling", 429), True),
    (_client_error("NoSuchKey", 404), False),
    (_client_error("AccessDenied", 403), False),
    (ValueError("sha256 mismatch"), False),
])
def test_which_s3_failures_may_pass(error: Exception, expected: bool) -> None:
    # Execute / Assert
    assert transient(error) is expected


def test_a_managed_uploads_wrapped_error_is_judged_by_what_it_wraps() -> None:
    # Prepare: boto3 raises its own error while handling the client error, which stays its context.
    def wrapped(cause: Exception) -> S3UploadFailedError:
        error = S3UploadFailedError("Failed to upload")
        error.__context__ = cause
        return error

    # Execute / Assert
    assert transient(wrapped(_client_error("SlowDown", 503)))
    assert not transient(wrapped(_client_error("AccessDenied", 403)))


# --- Waiting -----------------------------------------------------------------------------------------


def test_the_settings_give_a_small_capped_wait_with_no_limit_on_tries() -> None:
    # Execute
    backoff = Settings(retry_initial=0.25, retry_cap=4.0).dependency_backoff()

    # Assert
    assert [backoff.delay(n) for n in range(1, 8)] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


async def test_work_waits_while_its_dependency_is_away_with_one_line_per_growing_wait(
        caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: the database is away for five tries; waits 1, 2, 4, 4, 4 ms.
    tries = 0

    async def insert() -> str:
        nonlocal tries
        tries += 1
        if tries <= 5:
            raise DatabaseUnavailable("down", dependency="PostgreSQL at db:5432/apiary", reason="shutting down")
        return "inserted"

    # Execute
    with caplog.at_level(logging.INFO, logger="tests.wait"):
        result = await while_unavailable(insert, Backoff(base=0.001, cap=0.004), "aggregator: worker.done",
                                         logging.getLogger("tests.wait"))

    # Assert: a line for each growing wait (not for the waits at the cap), then one when done.
    waits = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert result == "inserted" and tries == 6
    assert waits == [f"aggregator: worker.done: waiting for PostgreSQL at db:5432/apiary: shutting down;"
                     f" retrying in {d:g} s" for d in (0.001, 0.002, 0.004)]
    assert any("done after waiting" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


async def test_a_wait_is_cancellable_and_other_failures_are_not_retried() -> None:
    # Prepare
    async def never_back() -> None:
        raise StorageUnavailable("frozen")

    async def broken() -> None:
        raise ValueError("bad weights")

    # Execute
    waiting = asyncio.create_task(while_unavailable(never_back, Backoff(base=0.01, cap=0.01), "t",
                                                    logging.getLogger("tests.wait")))
    await asyncio.sleep(0.05)
    waiting.cancel()

    # Assert
    with pytest.raises(asyncio.CancelledError):
        await waiting
    with pytest.raises(ValueError):
        await while_unavailable(broken, Backoff(), "t", logging.getLogger("tests.wait"))


# --- Transfers by URL --------------------------------------------------------------------------------


def test_a_transfer_with_a_deadline_retries_until_then_not_a_fixed_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a server failing 503 for longer than the attempt count would cover.
    monkeypatch.setattr(transfer, "RETRY", Backoff(attempts=2, base=0.001, cap=0.002))
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls <= 6:
            raise transfer._Transient("HTTP 503")
        return "sent"

    # Execute
    result = transfer._with_retries("upload to", "http://s3/b/k?X-Amz-Signature=s", flaky, time.time() + 30)

    # Assert
    assert (result, calls) == ("sent", 7)


def test_a_transfer_gives_up_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    monkeypatch.setattr(transfer, "RETRY", Backoff(attempts=100, base=0.01, cap=0.01))

    def down() -> None:
        raise transfer._Transient("HTTP 503")

    # Execute / Assert: the signature (a credential) is not in the message.
    with pytest.raises(transfer.TransferError, match=r"upload to http://s3/b/k failed after \d+ attempts") as e:
        transfer._with_retries("upload to", "http://s3/b/k?X-Amz-Signature=s", down, time.time() + 0.1)
    assert "Signature" not in str(e.value)
