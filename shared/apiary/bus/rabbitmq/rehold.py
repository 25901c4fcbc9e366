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

The same hold keeps a delivery past its handler (`Delivery.keep`, `Lease.set_apart`): a copy is fetched into a
hold queue of its own before the handler returns, and re-held at the same pace until it is released. The
handler's return settles the delivery itself and frees its slot (a fetched copy takes no prefetch slot); the
copy goes back to the origin queue if the process dies first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel, AbstractRobustQueue
from aiormq.exceptions import ChannelInvalidStateError

from apiary.bus.base import Kept, NothingKept
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
                 origin: str, every: float, ttl: float | None = None) -> None:
        self._publisher, self._topology, self._channel = publisher, topology, channel
        self.origin, self.every = origin, every
        self.ttl = ttl  # how soon a dead process's copy goes back (hold_arguments: `every` if None)

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
        fresh = await self._copy(held)
        if fresh is None:
            return
        await stop_consumer()
        held.message = fresh
        await old.ack()
        log.debug("re-held a delivery of %s through %s", self.origin, held.hold.name if held.hold else "")

    async def _copy(self, held: Held) -> AbstractIncomingMessage | None:
        """A fresh copy of the held delivery, fetched unacked from its hold queue (declared on first use); None
        if the delivery's channel has closed (`held.lost`: the broker has given it back) or the copy expired."""
        old = held.message
        try:
            old.channel  # noqa: B018 - raises if the channel that delivered it has closed
        except ChannelInvalidStateError:
            held.lost = True
            return None
        delivery = wire.incoming(old, self._publisher.user)
        if held.hold is None:
            held.hold = await self._topology.declare_hold(self._channel, self.origin, self.every, self.ttl)
        await self._publisher.send("", held.hold.name, wire.held_copy(old, delivery, self._publisher.user))
        fresh = await held.hold.get(no_ack=False, fail=False, timeout=10)
        if fresh is None:
            log.error("the held copy of %s expired before it was fetched", delivery.routing_key)
        return fresh

    async def set_apart(self, message: AbstractIncomingMessage) -> Kept:
        """Keep a delivery past its handler (`Delivery.keep`): a copy held unacked through a hold queue of its
        own, re-held every `every` seconds, and given back to the origin queue by the hold queue's TTL if this
        process dies. The delivery itself is settled by its handler's return as usual, freeing its slot (a
        fetched copy takes none). Where no copy could be made, the handler's settling is all there is (and
        said)."""
        apart = Held(message)
        try:
            fresh = await self._copy(apart)
        except Exception as e:
            log.error("could not keep a delivery on %s past its handler: %s", self.origin, e)
            fresh = None
        if fresh is None:
            await self.release(apart)
            return NothingKept()
        apart.message = fresh
        return KeptCopy(self, apart)

    async def release(self, held: Held) -> None:
        """Delete the hold queue of a settled delivery, if it was ever re-held."""
        if held.hold is not None:
            await self._topology.delete(held.hold.name)


async def _no_consumer() -> None:
    """A kept copy was fetched, not consumed: no consumer to stop when it is re-held."""


class KeptCopy(Kept):
    """A delivery kept past its handler as a copy held through its own hold queue (`Lease.set_apart`)."""

    def __init__(self, lease: Lease, held: Held) -> None:
        self._lease, self._held = lease, held
        self._renewing: asyncio.Task[None] | None = asyncio.create_task(lease.keep(held, _no_consumer),
                                                                        name=f"keep:{lease.origin}")

    async def release(self) -> None:
        renewing, self._renewing = self._renewing, None
        if renewing is None:
            return
        held = self._held
        await held.finish()  # waits for a re-hold under way: never cancelled between its copy and its ack
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
        if not held.lost:
            try:
                await held.message.ack()
            except wire.TRANSIENT as e:
                log.warning("a kept delivery on %s was not settled (%s); the broker gives it back", self._lease.origin,
                            e)
        with contextlib.suppress(Exception):
            await self._lease.release(held)
