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
_INTERNAL_HEADERS = (HELD_KEY_HEADER, REDELIVERED_HEADER)
# Added by the broker when it dead-letters (delay, hold and reroute queues), or a quorum queue's count of
# a message's deliveries: not the sender's headers.
_BROKER_HEADER_PREFIXES = ("x-death", "x-first-death-", "x-last-death-", "x-delivery-count")
# What a broker restart or a dropped connection raises: the call may work once the link is back.
TRANSIENT = (AMQPConnectionError, ChannelClosed, ChannelInvalidStateError, ConnectionError)


def _persistent(
    body: bytes, headers: dict[str, Any], content_type: str | None, message_id: str | None,
    user_id: str | None = None,
) -> aio_pika.Message:
    return aio_pika.Message(
        body=body,
        headers=headers,
        content_type=content_type,
        message_id=message_id,
        user_id=user_id,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


def outgoing(message: Delivery, user: str | None = None) -> aio_pika.Message:
    """A message to publish, persistent, with a fresh id unless it has one, and `user_id` the connection's
    user (RabbitMQ refuses a `user_id` that is not the connection's own, so consumers can trust it)."""
    return _persistent(message.body, message.headers, message.content_type, message.message_id or uuid.uuid4().hex,
                       user)


def dead_letter(delivery: Delivery, reason: str) -> aio_pika.Message:
    """A dead letter: why, and the routing key it came under (also kept where a re-hold keeps it)."""
    headers = {**dead_letter_headers(delivery, reason), HELD_KEY_HEADER: delivery.routing_key}
    return _persistent(delivery.body, headers, delivery.content_type, delivery.message_id)


def held_copy(message: AbstractIncomingMessage, routing_key: str) -> aio_pika.Message:
    """A copy that remembers its routing key and counts as redelivered if it comes back."""
    headers = {k: v for k, v in (message.headers or {}).items() if k != "x-delivery-count"}  # a fresh count
    headers.update({HELD_KEY_HEADER: routing_key, REDELIVERED_HEADER: True})
    return _persistent(message.body, headers, message.content_type, message.message_id)


def incoming(message: AbstractIncomingMessage) -> Delivery:
    """The delivery a handler sees: its original routing key, redelivered if any copy of it was."""
    raw = dict(message.headers or {})
    routing_key = raw.get(HELD_KEY_HEADER) or message.routing_key or ""
    redelivered = bool(message.redelivered) or bool(raw.get(REDELIVERED_HEADER))
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
        user_id=message.user_id,
    )
