"""Events on top of raw deliveries: encode on publish, decode and dispatch on consume."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypedDict, Unpack

from pydantic import BaseModel

from apiary import telemetry
from apiary.backoff import Backoff, while_unavailable
from apiary.bus.base import Bus, Delivery, Poison, Reroute, Subscription, topic_matches
from apiary.contracts import decode, encode
from apiary.settings import Settings

log = logging.getLogger("apiary.bus")

EventHandler = Callable[[Any, Delivery], Awaitable[None]]
Next = Callable[[], Awaitable[None]]
# Runs around a decoded event's handler: awaits `call_next()` to go on, or returns (or raises) to stop.
Middleware = Callable[[Any, Delivery, Next], Awaitable[None]]


class Routing(TypedDict, total=False):
    """Where and when an event goes: its own routing key unless `routing_key` is given, after `delay`
    seconds, with `headers` (the current trace context unless given)."""

    routing_key: str | None
    delay: float | None
    headers: dict[str, Any] | None


class Raw:
    """Marks a handler that takes the undecoded delivery (for messages it must judge itself)."""

    def __init__(self, handler: Callable[[Delivery], Awaitable[None]]) -> None:
        self.handler = handler


async def publish_event(bus: Bus, event: BaseModel, *, persistent: bool = True, **routing: Unpack[Routing]) -> None:
    """Publish an event under its own routing key (or the one given, for assignments); not kept on the broker's
    disk if not `persistent`."""
    key = routing.get("routing_key") or str(getattr(event, "routing_key", ""))
    headers = {**telemetry.headers_for(), **(routing.get("headers") or {})}
    await bus.publish(key, encode(event), headers=headers, delay=routing.get("delay"), persistent=persistent)


def consumer_span(exchange: str, attributes: Callable[[Any], Mapping[str, Any]]) -> Middleware:
    """Middleware that handles each event inside its consumer span (`<routing key> process`, with
    OpenTelemetry's messaging attributes and the event's own, `attributes(event)`)."""

    async def traced(event: Any, delivery: Delivery, call_next: Next) -> None:
        with telemetry.consumer_span(delivery.routing_key, exchange, attributes(event)):
            await call_next()

    return traced


async def _through(middleware: Sequence[Middleware], event: Any, delivery: Delivery,
                   handler: EventHandler) -> None:
    """Call the handler inside the middleware, the first outermost."""
    if not middleware:
        await handler(event, delivery)
        return
    await middleware[0](event, delivery, lambda: _through(middleware[1:], event, delivery, handler))


async def subscribe(
    bus: Bus,
    queue: str,
    handlers: Mapping[str, EventHandler | Raw],
    *,
    prefetch: int = 16,
    expires: float | None = None,
    reroute: Reroute | None = None,
    middleware: Sequence[Middleware] = (),
    retry: Backoff | None = None,
) -> Subscription:
    """Declare `queue` bound to the handlers' patterns (see `Bus.declare_queue` for `expires` and
    `reroute`) and dispatch each decoded event, through the `middleware` (not `Raw` deliveries).

    A handler that fails because a dependency is away (DependencyUnavailable) is run again, after a
    wait growing by `retry` (default: the `APIARY_RETRY_*` settings), for as long as it stays away. The
    delivery stays unacked meanwhile, so `prefetch` keeps the consumer from taking new work; stopping the
    subscription cancels the wait and the message goes back to its queue.
    """
    await bus.declare_queue(queue, list(handlers), expires=expires, reroute=reroute)
    backoff = retry or Settings().dependency_backoff()

    async def handle(delivery: Delivery) -> None:
        for pattern, handler in handlers.items():
            if topic_matches(pattern, delivery.routing_key):
                # The message's trace context is current while it is handled, so what the handler
                # publishes stays in the same trace.
                with telemetry.attached(delivery.headers):
                    if isinstance(handler, Raw):
                        await handler.handler(delivery)
                        return
                    event = decode(delivery.routing_key, delivery.body, delivery.content_type)
                    await _through(middleware, event, delivery, handler)
                return
        raise Poison(f"queue {queue} has no handler for {delivery.routing_key!r}")

    async def dispatch(delivery: Delivery) -> None:
        await while_unavailable(lambda: handle(delivery), backoff, f"{queue}: {delivery.routing_key}", log)

    return await bus.consume(queue, dispatch, prefetch=prefetch)
