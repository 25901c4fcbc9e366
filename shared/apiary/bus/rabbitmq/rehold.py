"""Keeping a long handler's delivery unacked past the broker's consumer acknowledgement timeout.

RabbitMQ closes a channel whose oldest unacked delivery is older than `consumer_timeout` (30 min by
default), and 3.10 has no per-queue or per-consumer override (`x-consumer-timeout` arrived in 3.12). A worker
holds its assignment unacked while it trains, so that a dead worker's assignment returns to the pool. To keep
that without tripping the timeout, a handler still running after `lease_renewal` seconds has its delivery
re-held: a copy is published to a private hold queue `{exchange}.hold.<uuid>`, fetched unacked on the same
channel (a fresh delivery, so a fresh timeout), and only then is the older delivery acked. The hold queue
dead-letters through the default exchange back to the origin queue with a short message TTL, so if the process
dies the copy is requeued and goes back to the pool once its TTL has passed (at once if held longer), marked
redelivered.
`lease_renewal` must be well under the broker's `consumer_timeout` (the broker checks once per
`channel_tick_interval`, 60 s by default). Raising `consumer_timeout` on the broker is not needed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel, AbstractRobustQueue
from aiormq.exceptions import ChannelInvalidStateError

from apiary.bus.rabbitmq import wire
from apiary.bus.rabbitmq.publisher import Publisher
from apiary.bus.rabbitmq.topology import Topology

log = logging.getLogger("apiary.bus.rabbitmq")

# Cancels the consumer that took a delivery, so that acking the original frees no credit for another.
StopConsumer = Callable[[], Awaitable[None]]


class Held:
    """One in-flight delivery; `message` is whichever delivery holds it now (original or copy)."""

    def __init__(self, message: AbstractIncomingMessage) -> None:
        self.message = message
        self.hold: AbstractRobustQueue | None = None
        self.lock = asyncio.Lock()
        self.active = True
        self.lost = False

    async def finish(self) -> None:
        """Re-hold it no more: its handler has ended (waits for a re-hold under way)."""
        async with self.lock:
            self.active = False


class Lease:
    """Re-holds the deliveries of one subscription's queue every `every` seconds while their handler runs."""

    def __init__(self, publisher: Publisher, topology: Topology, channel: AbstractRobustChannel,
                 origin: str, every: float) -> None:
        self._publisher, self._topology, self._channel = publisher, topology, channel
        self.origin, self.every = origin, every

    async def keep(self, held: Held, stop_consumer: StopConsumer) -> None:
        """Re-hold `held` until it is finished or lost (run as a task; cancel it when the handler ends)."""
        while True:
            await asyncio.sleep(self.every)
            async with held.lock:
                if not held.active:
                    return
                try:
                    await self._renew(held, stop_consumer)
                except Exception as e:
                    log.error("could not re-hold a delivery on %s: %s", self.origin, e)
                if held.lost:
                    return

    async def _renew(self, held: Held, stop_consumer: StopConsumer) -> None:
        """Swap the held delivery for a fresh copy from the hold queue, then ack the old one."""
        old = held.message
        try:
            old.channel  # noqa: B018 - raises if the channel that delivered it has closed
        except ChannelInvalidStateError:
            held.lost = True
            return
        delivery = wire.incoming(old, self._publisher.user)
        routing_key = delivery.routing_key
        if held.hold is None:
            held.hold = await self._topology.declare_hold(self._channel, self.origin, self.every)
        await self._publisher.send("", held.hold.name, wire.held_copy(old, delivery, self._publisher.user))
        fresh = await held.hold.get(no_ack=False, fail=False, timeout=10)
        if fresh is None:
            log.error("the held copy of %s expired before it was fetched", routing_key)
            return
        await stop_consumer()
        held.message = fresh
        await old.ack()
        log.debug("re-held %s on %s through %s", routing_key, self.origin, held.hold.name)

    async def release(self, held: Held) -> None:
        """Delete the hold queue of a settled delivery, if it was ever re-held."""
        if held.hold is not None:
            await self._topology.delete(held.hold.name)
