"""Events on top of raw deliveries: encode on publish, decode and dispatch on consume."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pydantic import BaseModel

from apiary import telemetry
from apiary.bus.base import Bus, Delivery, Poison, Reroute, Subscription, topic_matches
from apiary.contracts import decode, encode

EventHandler = Callable[[Any, Delivery], Awaitable[None]]


class Raw:
    """Marks a handler that takes the undecoded delivery (for messages it must judge itself)."""

    def __init__(self, handler: Callable[[Delivery], Awaitable[None]]) -> None:
        self.handler = handler


async def publish_event(
    bus: Bus,
    event: BaseModel,
    *,
    routing_key: str | None = None,
    delay: float | None = None,
    headers: dict[str, Any] | None = None,
) -> None:
    """Publish an event under its own routing key (or the one given, for assignments)."""
    key = routing_key or str(getattr(event, "routing_key", ""))
    await bus.publish(key, encode(event), headers={**telemetry.headers_for(), **(headers or {})}, delay=delay)


async def subscribe(
    bus: Bus,
    queue: str,
    handlers: Mapping[str, EventHandler | Raw],
    *,
    prefetch: int = 16,
    expires: float | None = None,
    reroute: Reroute | None = None,
) -> Subscription:
    """Declare `queue` bound to the handlers' patterns (see `Bus.declare_queue` for `expires` and
    `reroute`) and dispatch each decoded event."""
    await bus.declare_queue(queue, list(handlers), expires=expires, reroute=reroute)

    async def dispatch(delivery: Delivery) -> None:
        for pattern, handler in handlers.items():
            if topic_matches(pattern, delivery.routing_key):
                # The message's trace context is current while it is handled, so what the handler
                # publishes stays in the same trace.
                with telemetry.attached(delivery.headers):
                    if isinstance(handler, Raw):
                        await handler.handler(delivery)
                        return
                    event = decode(delivery.routing_key, delivery.body, delivery.content_type)
                    await handler(event, delivery)
                return
        raise Poison(f"queue {queue} has no handler for {delivery.routing_key!r}")

    return await bus.consume(queue, dispatch, prefetch=prefetch)
