"""Between the port's `Delivery` and AMQP messages: what the adapter adds to headers, and strips again."""

from __future__ import annotations

import uuid
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from aiormq.exceptions import AMQPConnectionError, ChannelClosed, ChannelInvalidStateError

from apiary.bus.base import Delivery, dead_letter_headers

HELD_KEY_HEADER = "x-apiary-held-routing-key"
REDELIVERED_HEADER = "x-apiary-redelivered"
# The user id of the message a copy was made from: the copy itself is published as its consumer's user.
HELD_USER_HEADER = "x-apiary-held-user-id"
_INTERNAL_HEADERS = (HELD_KEY_HEADER, REDELIVERED_HEADER, HELD_USER_HEADER)
# Added by the broker when it dead-letters (delay, hold and reroute queues), or a quorum queue's count of
# a message's deliveries: not the sender's headers.
_BROKER_HEADER_PREFIXES = ("x-death", "x-first-death-", "x-last-death-", "x-delivery-count")
# What a broker restart or a dropped connection raises: the call may work once the link is back.
TRANSIENT = (AMQPConnectionError, ChannelClosed, ChannelInvalidStateError, ConnectionError)


def _persistent(
    body: bytes, headers: dict[str, Any], content_type: str | None, message_id: str | None,
    user_id: str | None = None, persistent: bool = True,
) -> aio_pika.Message:
    return aio_pika.Message(
        body=body,
        headers=headers,
        content_type=content_type,
        message_id=message_id,
        user_id=user_id,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT if persistent else aio_pika.DeliveryMode.NOT_PERSISTENT,
    )


def outgoing(message: Delivery, user: str | None = None) -> aio_pika.Message:
    """A message to publish, persistent unless it says not, with a fresh id unless it has one, and `user_id` the
    connection's user (RabbitMQ refuses a `user_id` that is not the connection's own, so consumers can trust it)."""
    return _persistent(message.body, message.headers, message.content_type, message.message_id or uuid.uuid4().hex,
                       user, message.persistent)


def dead_letter(delivery: Delivery, reason: str, user: str | None = None) -> aio_pika.Message:
    """A dead letter: why, and the routing key and user id it came under (also kept where a re-hold keeps
    them), published as `user`."""
    headers = {**dead_letter_headers(delivery, reason), HELD_KEY_HEADER: delivery.routing_key}
    if delivery.user_id is not None:
        headers[HELD_USER_HEADER] = delivery.user_id
    return _persistent(delivery.body, headers, delivery.content_type, delivery.message_id, user)


def held_copy(message: AbstractIncomingMessage, delivery: Delivery, user: str | None = None) -> aio_pika.Message:
    """A copy of a delivery, published as its consumer's `user`, that remembers the routing key and user id the
    delivery came under and counts as redelivered if it comes back."""
    headers = {k: v for k, v in (message.headers or {}).items()
               if k not in ("x-delivery-count", HELD_USER_HEADER)}  # a fresh count
    headers.update({HELD_KEY_HEADER: delivery.routing_key, REDELIVERED_HEADER: True})
    if delivery.user_id is not None:
        headers[HELD_USER_HEADER] = delivery.user_id
    return _persistent(message.body, headers, message.content_type, message.message_id, user)


def incoming(message: AbstractIncomingMessage, user: str | None = None) -> Delivery:
    """The delivery a handler sees: its original routing key and user id, redelivered if any copy of it was.

    Only a copy this consumer's own user made (its broker-validated user id is `user`) is believed about its
    original routing key and publisher: anyone may put a message with those headers straight into a queue
    through the default exchange. A copy comes straight to its queue (the default exchange, also when a hold
    queue returns it): one the broker dead-lettered through the exchange (a queue's reroute) is a new message
    there, under its new routing key, and not a redelivery.
    It is `returned` if it is a copy of its consumer's own user that expired out of a hold queue on its way (its
    holder was lost), whether straight back to its queue or on through a reroute (a worker's preferred queue, then
    the pool).
    """
    raw = dict(message.headers or {})
    by_name = HELD_KEY_HEADER in raw and not message.exchange
    ours = user is None or message.user_id == user
    copied = by_name and ours
    routing_key = (raw.get(HELD_KEY_HEADER) if copied else None) or message.routing_key or ""
    user_id = raw.get(HELD_USER_HEADER) if copied else message.user_id
    redelivered = bool(message.redelivered) or (by_name and bool(raw.get(REDELIVERED_HEADER)))
    headers = {
        k: v for k, v in raw.items()
        if k not in _INTERNAL_HEADERS and not k.startswith(_BROKER_HEADER_PREFIXES)
    }
    return Delivery(
        routing_key=str(routing_key),
        body=message.body,
        headers=headers,
        content_type=message.content_type,
        message_id=message.message_id,
        redelivered=redelivered,
        returned=ours and HELD_KEY_HEADER in raw and _expired_from_hold(raw.get("x-death")),
        user_id=None if user_id is None else str(user_id),
        persistent=message.delivery_mode != aio_pika.DeliveryMode.NOT_PERSISTENT,
    )


def _expired_from_hold(deaths: Any) -> bool:
    """Whether the broker's `x-death` record says the message expired out of a hold queue (its holder died)."""
    return isinstance(deaths, list) and any(
        isinstance(d, dict) and d.get("reason") == "expired" and ".hold." in str(d.get("queue", "")) for d in deaths)
