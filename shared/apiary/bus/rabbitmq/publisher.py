"""Publishing on RabbitMQ: `mandatory` with a broker confirm, delays through TTL queues, dead letters."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aio_pika
from aiormq.exceptions import DeliveryError, PublishError

from apiary.bus.base import DEAD_LETTER_QUEUE, Delivery, Unroutable
from apiary.bus.rabbitmq import wire
from apiary.bus.rabbitmq.connection import Connection
from apiary.bus.rabbitmq.topology import Topology

log = logging.getLogger("apiary.bus.rabbitmq")


class Publisher:
    """Sends on the connection's confirming channel, waiting out a reconnect for up to `timeout` seconds."""

    def __init__(self, connection: Connection, topology: Topology, *, timeout: float,
                 user: str | None = None) -> None:
        self._connection = connection
        self.user = user  # stamped as each message's user_id
        self._topology = topology
        self.timeout = timeout

    async def publish(self, message: Delivery, delay: float | None) -> None:
        """Route a message through the exchange, or first through the queue for its delay."""
        routing_key = message.routing_key
        amqp = wire.outgoing(message, self.user)
        try:
            if delay is not None:
                await self.send("", await self._topology.declare_delay(routing_key, delay), amqp)
            else:
                await self.send(self._topology.exchange, routing_key, amqp)
        except TypeError as e:
            raise ValueError(
                f"message for {routing_key!r} cannot be sent over AMQP: {e}"
                " (header values must be str, int, float, bool, None, or lists and dicts of them)"
            ) from e

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Put a delivery on the dead-letter queue, saying why."""
        await self.send("", self._topology.queue_name(DEAD_LETTER_QUEUE), wire.dead_letter(delivery, reason, self.user))

    async def send(self, exchange_name: str, routing_key: str, message: aio_pika.Message) -> None:
        """Publish with mandatory and a confirm (`exchange_name` "" is the default exchange, straight to a
        queue); wait out a reconnect up to `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            channel, exchange = self._connection.publishing()
            target = exchange if exchange_name else channel.default_exchange
            try:
                await target.publish(message, routing_key, mandatory=True, timeout=self.timeout)
                return
            except PublishError as e:
                raise Unroutable(f"no queue is bound for routing key {routing_key!r}") from e
            except DeliveryError as e:
                # A nack: the broker took no responsibility for the message (a quorum queue without its quorum,
                # or one being deleted as it expires). Sent again until the deadline: it is stored, or it turns
                # out unroutable (consumers are idempotent, so a copy a queue did keep is harmless).
                if loop.time() >= deadline:
                    raise Unroutable(f"the broker refused the message for routing key {routing_key!r} (nack) for"
                                     f" {self.timeout:g} s") from e
                log.warning("the broker refused %s (nack); sending it again", routing_key)
                await asyncio.sleep(0.1)
            except wire.TRANSIENT as e:
                left = deadline - loop.time()
                if left <= 0:
                    raise
                log.warning("publish of %s failed (%s); retrying when the broker is back", routing_key, e)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(channel.ready(), left)
                await asyncio.sleep(0.1)
