"""The RabbitMQ adapter's pure parts: queue arguments (expiry, reroute, a queue per delay, hold queues) and
the headers a copy carries through the broker and loses again on delivery."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from aio_pika.abc import AbstractIncomingMessage

from apiary.bus import Delivery, Reroute
from apiary.bus.rabbitmq import wire
from apiary.bus.rabbitmq.topology import delay_queue, hold_arguments, queue_arguments


def _received(message: Any, *, routing_key: str, redelivered: bool = False, exchange: str = "",
              extra: dict[str, Any] | None = None) -> AbstractIncomingMessage:
    """What the broker hands a consumer for a message it was sent (with headers it may add), through
    `exchange` ("": the default exchange, straight to the queue)."""
    return cast(AbstractIncomingMessage, SimpleNamespace(
        body=message.body, headers={**(message.headers or {}), **(extra or {})},
        content_type=message.content_type, message_id=message.message_id, exchange=exchange,
        routing_key=routing_key, redelivered=redelivered, user_id=message.user_id,
        delivery_mode=message.delivery_mode,
    ))


def test_a_plain_queue_has_no_arguments_and_a_rerouting_one_dead_letters_into_the_exchange() -> None:
    # Execute
    plain = queue_arguments("apiary", None, None)
    rerouting = queue_arguments("apiary", 30.0, Reroute(after=2.0, to="assign.pool"))

    # Assert
    assert plain is None
    assert rerouting == {"x-expires": 30_000, "x-message-ttl": 2000, "x-dead-letter-exchange": "apiary",
                         "x-dead-letter-routing-key": "assign.pool"}


def test_each_delay_has_its_own_queue_that_routes_back_under_the_same_key() -> None:
    # Execute
    name, arguments = delay_queue("apiary", "round.timeout", 0.0001)

    # Assert: at least a millisecond, and the queue outlives its TTL by ten minutes.
    assert name == "apiary.delay.1.round.timeout"
    assert arguments == {"x-message-ttl": 1, "x-dead-letter-exchange": "apiary",
                         "x-dead-letter-routing-key": "round.timeout", "x-expires": 600_001}


def test_a_delay_queue_name_over_the_broker_limit_is_refused() -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="over 255 bytes"):
        delay_queue("apiary", "k" * 250, 1.0)


def test_a_hold_queue_returns_its_copy_to_the_origin_within_thirty_seconds() -> None:
    # Execute
    often, rarely = hold_arguments("apiary.assign.pool", 0.5), hold_arguments("apiary.assign.pool", 600.0)

    # Assert: the TTL is clamped to 5..30 s (a copy must outlive its publish-and-fetch on a busy machine); the
    # queue itself goes once unused for three renewals and a minute.
    assert (often["x-message-ttl"], rarely["x-message-ttl"]) == (5000, 30_000)
    assert (often["x-dead-letter-exchange"], often["x-dead-letter-routing-key"]) == ("", "apiary.assign.pool")
    assert rarely["x-expires"] == (3 * 600 + 60) * 1000
    # A kept delivery's hold queue returns it sooner than its re-holds' pace.
    assert hold_arguments("apiary.assign.pool", 600.0, ttl=10.0)["x-message-ttl"] == 10_000


def test_a_held_copy_is_delivered_under_its_original_key_as_redelivered_without_internal_headers() -> None:
    # Prepare: a message first delivered under job.requested, then copied into a hold queue.
    sent = wire.outgoing(Delivery("job.requested", b"x", headers={"job_id": "j1"}), "apiary-tracker")
    first = _received(sent, routing_key="job.requested")
    copy = wire.held_copy(first, wire.incoming(first, "apiary-scheduler"), "apiary-scheduler")

    # Execute: the copy comes back through the default exchange, with the broker's x-death headers.
    broker_headers = {"x-death": [], "x-first-death-queue": "apiary.hold.1"}
    delivery = wire.incoming(_received(copy, routing_key="apiary.hold.1", extra=broker_headers), "apiary-scheduler")

    # Assert: under its first routing key and publisher, though the copy was published by its consumer
    assert (delivery.routing_key, delivery.body, delivery.redelivered) == ("job.requested", b"x", True)
    assert delivery.headers == {"job_id": "j1"}
    assert not delivery.returned  # the broker's x-death records no expiry out of a hold queue
    expired = {"x-death": [{"queue": "apiary.hold.1", "reason": "expired"}]}
    assert wire.incoming(_received(copy, routing_key="apiary.hold.1", extra=expired), "apiary-scheduler").returned
    assert delivery.message_id == sent.message_id is not None
    assert (copy.user_id, delivery.user_id) == ("apiary-scheduler", "apiary-tracker")


def test_a_copy_someone_else_made_is_not_believed_about_its_routing_key_or_publisher() -> None:
    # Prepare: a worker puts a "copy" straight into the scheduler's queue through the default exchange
    forged = wire.outgoing(Delivery("apiary.scheduler", b"x", headers={
        wire.HELD_KEY_HEADER: "round.aggregated", wire.HELD_USER_HEADER: "apiary-aggregator"}), "apiary-worker.w1")

    # Execute
    delivery = wire.incoming(_received(forged, routing_key="apiary.scheduler"), "apiary-scheduler")

    # Assert
    assert (delivery.routing_key, delivery.user_id) == ("apiary.scheduler", "apiary-worker.w1")
    assert delivery.headers == {}


def test_a_copy_rerouted_through_the_exchange_arrives_under_its_new_key_as_a_fresh_delivery() -> None:
    # Prepare: a worker declined a preferred assignment (on quorum queues: a copy it published itself)...
    sent = wire.outgoing(Delivery("assign.prefer.w1", b"x", headers={"job_id": "j1"}), "apiary-scheduler")
    first = _received(sent, routing_key="assign.prefer.w1", exchange="apiary")
    copy = wire.held_copy(first, wire.incoming(first, "apiary-workers"), "apiary-workers")

    # Execute: ...then passed the copy on: the broker dead-letters it into the exchange under assign.pool, where
    # a worker of the same (shared) user takes it.
    death = {"x-death": [{"queue": "apiary.assign.prefer.w1", "reason": "rejected"}],
             "x-first-death-reason": "rejected"}
    delivery = wire.incoming(_received(copy, routing_key="assign.pool", exchange="apiary", extra=death),
                             "apiary-workers")

    # Assert: the pool's key (its handler is found), not a redelivery (a first failure is retried), and
    # none of the broker's or the adapter's headers.
    assert (delivery.routing_key, delivery.redelivered, delivery.returned) == ("assign.pool", False, False)
    assert delivery.headers == {"job_id": "j1"}


def test_a_kept_copy_whose_holder_died_comes_back_returned_through_a_reroute_too() -> None:
    # Prepare: a worker kept a preferred assignment past its handler (a held copy) and died; the copy expired out of
    # its hold queue back into the preferred queue...
    sent = wire.outgoing(Delivery("assign.prefer.w1", b"x", headers={"job_id": "j1"}), "apiary-scheduler")
    first = _received(sent, routing_key="assign.prefer.w1", exchange="apiary")
    copy = wire.held_copy(first, wire.incoming(first, "apiary-workers"), "apiary-workers")

    # Execute: ...and on from there, unclaimed, into the exchange under assign.pool.
    deaths = {"x-death": [{"queue": "apiary.assign.prefer.w1", "reason": "expired"},
                          {"queue": "apiary.hold.5042d1ea", "reason": "expired"}]}
    delivery = wire.incoming(_received(copy, routing_key="assign.pool", exchange="apiary", extra=deaths),
                             "apiary-workers")
    forged = wire.incoming(_received(copy, routing_key="assign.pool", exchange="apiary", extra=deaths),
                           "apiary-scheduler")

    # Assert: the pool's key, and returned (the worker that takes it learns its first holder was lost), only for a
    # copy its consumer's own user made; a fresh delivery there (not a redelivery: a first failure is retried).
    assert (delivery.routing_key, delivery.returned, delivery.redelivered) == ("assign.pool", True, False)
    assert delivery.headers == {"job_id": "j1"}
    assert not forged.returned


def test_a_dead_letter_says_why_and_under_which_key_it_came() -> None:
    # Execute
    letter = wire.dead_letter(Delivery("worker.done", b"x", headers={"job_id": "j1"}), "bad weights")

    # Assert
    assert letter.headers is not None
    assert letter.headers["x-apiary-reason"] == "bad weights"
    assert letter.headers["x-apiary-routing-key"] == "worker.done"
    assert letter.headers["job_id"] == "j1"
