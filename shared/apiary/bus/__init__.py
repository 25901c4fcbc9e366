"""The bus port: topic publish/subscribe with durable queues, acks, dead letters and delays."""

from apiary.bus.base import (
    Bus,
    Decline,
    Delivery,
    Handler,
    Kept,
    Outcome,
    PassOn,
    Poison,
    Reroute,
    Retryable,
    Subscription,
    Unroutable,
    decide,
    topic_matches,
)
from apiary.bus.factory import make_bus
from apiary.bus.typed import EventHandler, Raw, publish_event, subscribe

__all__ = [
    "Bus",
    "Decline",
    "Delivery",
    "EventHandler",
    "Handler",
    "Kept",
    "Outcome",
    "PassOn",
    "Poison",
    "Raw",
    "Reroute",
    "Retryable",
    "Subscription",
    "Unroutable",
    "decide",
    "make_bus",
    "publish_event",
    "subscribe",
    "topic_matches",
]
