"""The RabbitMQ bus: the port's operations, composed from the connection, topology, publisher and subscribers."""

from __future__ import annotations

import os
from collections.abc import Sequence

from aio_pika.abc import AbstractRobustConnection

from apiary.bus.base import DEAD_LETTER_QUEUE, Bus, Delivery, Handler, Reroute, Subscription
from apiary.bus.identity import is_worker_user
from apiary.bus.rabbitmq import wire
from apiary.bus.rabbitmq.connection import Connection, user_of
from apiary.bus.rabbitmq.publisher import Publisher
from apiary.bus.rabbitmq.rehold import Lease
from apiary.bus.rabbitmq.subscriber import RabbitSubscription
from apiary.bus.rabbitmq.topology import Topology
from apiary.telemetry import MESSAGING_SYSTEM

KEEP_RENEWAL = 600.0  # seconds between re-holds of a kept delivery where handlers' deliveries are never re-held
KEEP_RETURN = 10.0  # seconds at most before a kept delivery whose process died goes back to its queue


class RabbitBus(Bus):
    """The bus on RabbitMQ through aio-pika, reconnecting by itself after a broker restart.

    `lease_renewal` (seconds, or None for never) is how often a running handler's delivery is re-held
    (see `apiary.bus.rabbitmq.rehold`); `retry_delay` is the pause before a `Retryable` is requeued.
    With `keep_unroutable` the exchange gets an alternate exchange (`{exchange}.unroutable`) that routes
    a message no queue is bound for into the dead-letter queue, where it is kept and visible, instead of
    it being returned (Unroutable) or lost.
    `queue_type` `quorum` declares every queue as a quorum queue with `delivery_limit` (see `topology`); a
    requeue (Retryable, Decline) is then a fresh copy, so that waiting on a dependency never reaches the limit.
    """

    # What a publish raises once the broker has been away past its timeout: the broker is unavailable.
    unavailable = wire.TRANSIENT
    system = MESSAGING_SYSTEM

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "apiary",
        retry_delay: float = 0.5,
        lease_renewal: float | None = 600.0,
        publish_timeout: float = 30.0,
        reconnect_interval: float = 2.0,
        connection_name: str | None = None,
        keep_unroutable: bool = False,
        queue_type: str = "classic",
        delivery_limit: int = 20,
    ) -> None:
        if not exchange or len(exchange) > 200:
            raise ValueError(f"exchange name {exchange!r} is invalid: expected 1 to 200 characters")
        self.url = url
        self.exchange = exchange
        self.retry_delay = retry_delay
        self.lease_renewal = lease_renewal
        self.publish_timeout = publish_timeout
        self.reconnect_interval = reconnect_interval
        self.connection_name = connection_name or f"apiary {exchange} pid {os.getpid()}"
        self.keep_unroutable = keep_unroutable
        self._link = Connection(url, name=self.connection_name, reconnect_interval=reconnect_interval)
        self._topology = Topology(self._link, exchange, queue_type=queue_type, delivery_limit=delivery_limit)
        self._publisher = Publisher(self._link, self._topology, timeout=publish_timeout, user=user_of(url))
        self._subscriptions: set[RabbitSubscription] = set()
        # A worker's broker user (apiary broker setup) may declare only its own queues: it checks that what the
        # services declare is there instead of declaring it.
        self.passive_topology = is_worker_user(user_of(url))

    @property
    def _connection(self) -> AbstractRobustConnection | None:
        """The robust connection, None until connected (tests close it to play a dying process)."""
        return self._link.robust

    def queue_name(self, name: str) -> str:
        """The broker's name for a logical queue."""
        return self._topology.queue_name(name)

    async def connect(self) -> None:
        if self._link.robust is not None:
            return
        if self.passive_topology:
            await self._link.open_existing(self.exchange)
            await self._require([DEAD_LETTER_QUEUE, *self.layout])
            return
        alternate = self._topology.unroutable_exchange if self.keep_unroutable else None
        has_alternate = await self._link.open(self.exchange, alternate)
        await self.declare_queue(DEAD_LETTER_QUEUE, [])
        if has_alternate:
            await self._topology.bind_unroutable()
        await self.declare_layout()

    async def _require(self, queues: Sequence[str]) -> None:
        """Check that the services declared these queues (a worker's user may not declare them)."""
        for name in queues:
            if await self._topology.ready_count(self.queue_name(name)) is None:
                await self._link.close()
                raise ConnectionError(f"RabbitMQ has no queue {self.queue_name(name)!r} yet: start the services "
                                      "first (they declare it), then the workers")

    async def close(self) -> None:
        for sub in list(self._subscriptions):
            await sub.cancel()
        await self._link.close()

    async def declare_queue(self, name: str, bindings: Sequence[str], *, expires: float | None = None,
                            reroute: Reroute | None = None) -> None:
        await self._topology.declare(name, bindings, expires=expires, reroute=reroute)

    async def _publish(self, message: Delivery, delay: float | None) -> None:
        await self._publisher.publish(message, delay)

    async def consume(self, queue: str, handler: Handler, *, prefetch: int = 16) -> Subscription:
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        name = self.queue_name(queue)
        if await self._topology.ready_count(name) is None:
            raise ValueError(f"queue {queue!r} is not declared")
        channel = await self._link.consumer_channel()
        await channel.set_qos(prefetch_count=1)
        amqp_queue = await channel.declare_queue(name, passive=True)
        lease = None
        if self.lease_renewal:
            lease = Lease(self._publisher, self._topology, channel, amqp_queue.name, self.lease_renewal)
        # Deliveries kept past their handler (Delivery.keep) are re-held at the lease's pace, or the default's, and
        # go back sooner: their holder's death is what another consumer waits to learn of.
        keeping = Lease(self._publisher, self._topology, channel, amqp_queue.name,
                        self.lease_renewal or KEEP_RENEWAL, ttl=KEEP_RETURN)
        sub = RabbitSubscription(amqp_queue, channel, handler, prefetch, publisher=self._publisher, lease=lease,
                                 retry_delay=self.retry_delay, on_cancel=self._subscriptions.discard,
                                 requeue_by_copy=self._topology.queue_type == "quorum",
                                 reroutes=name in self._topology.rerouting, keeping=keeping)
        self._subscriptions.add(sub)
        try:
            await sub.start()
        except BaseException:
            await sub.cancel()
            raise
        return sub

    async def purge(self, queue: str) -> int:
        return await self._topology.purge(queue)

    async def queue_size(self, queue: str) -> int:
        return await self._topology.ready_count(self.queue_name(queue)) or 0

    async def delete_namespace(self) -> None:
        """Delete every queue this bus declared and its exchange (for tests and teardown)."""
        for sub in list(self._subscriptions):
            await sub.cancel()
        await self._topology.delete_all()
