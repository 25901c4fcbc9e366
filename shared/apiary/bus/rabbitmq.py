"""The RabbitMQ bus: one durable topic exchange, durable queues, confirms, dead letters and delays.

Names: the exchange is `exchange`; a logical queue `name` is the durable queue `{exchange}.{name}`;
dead letters go to `{exchange}.dead` through the default exchange; a delayed publish waits in
`{exchange}.delay.{ms}.{routing_key}` (a queue per delay value, since RabbitMQ only expires the head
of a queue) and dead-letters into the exchange when its TTL runs out.

Long handlers and the broker's consumer acknowledgement timeout (`consumer_timeout`, 30 min by
default): RabbitMQ closes a channel whose oldest unacked delivery is older than the timeout, and
3.10 has no per-queue or per-consumer override (`x-consumer-timeout` arrived in 3.12). A worker
holds its assignment unacked while it trains, so that a dead worker's assignment returns to the
pool. To keep that without tripping the timeout, a handler still running after `lease_renewal`
seconds has its delivery re-held: a copy is published to a private hold queue
`{exchange}.hold.<uuid>`, fetched unacked on the same channel (a fresh delivery, so a fresh
timeout), and only then is the older delivery acked. The hold queue dead-letters through the
default exchange back to the origin queue with a short message TTL, so if the process dies the
copy is requeued, has already expired, and goes straight back to the pool, marked redelivered.
`lease_renewal` must be well under the broker's `consumer_timeout` (the broker checks once per
`channel_tick_interval`, 60 s by default). Raising `consumer_timeout` on the broker is not needed.

Concurrency: a subscription is one channel holding `prefetch` consumers of prefetch 1 each, so
re-holding a delivery can cancel that one consumer (freeing no extra broker credit) and the number
of running handlers never exceeds `prefetch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractRobustChannel,
    AbstractRobustConnection,
    AbstractRobustExchange,
    AbstractRobustQueue,
)
from aiormq.exceptions import (
    AMQPConnectionError,
    ChannelClosed,
    ChannelInvalidStateError,
    ChannelNotFoundEntity,
    PublishError,
)

from apiary.bus.base import (
    DEAD_LETTER_QUEUE,
    Bus,
    Delivery,
    Handler,
    Outcome,
    Reroute,
    Retryable,
    Subscription,
    Unroutable,
    dead_letter_headers,
    judge,
)

log = logging.getLogger("apiary.bus.rabbitmq")

HELD_KEY_HEADER = "x-apiary-held-routing-key"
REDELIVERED_HEADER = "x-apiary-redelivered"
_INTERNAL_HEADERS = (HELD_KEY_HEADER, REDELIVERED_HEADER)
_BROKER_HEADER_PREFIXES = ("x-death", "x-first-death-", "x-last-death-")
_TRANSIENT = (AMQPConnectionError, ChannelClosed, ChannelInvalidStateError, ConnectionError)
_PERSISTENT = aio_pika.DeliveryMode.PERSISTENT


def _where(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname or 'localhost'}:{parts.port or 5672}"


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Held:
    """One in-flight delivery; `message` is whichever delivery holds it now (original or copy)."""

    def __init__(self, message: AbstractIncomingMessage) -> None:
        self.message = message
        self.hold: AbstractRobustQueue | None = None
        self.lock = asyncio.Lock()
        self.active = True
        self.lost = False


class _RabbitSubscription(Subscription):
    def __init__(
        self, bus: RabbitBus, queue: AbstractRobustQueue, channel: AbstractRobustChannel,
        handler: Handler, prefetch: int,
    ) -> None:
        self._bus, self._queue, self._channel = bus, queue, channel
        self._handler, self._prefetch = handler, prefetch
        self._tags: dict[int, str | None] = {}
        self._held: set[_Held] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._busy_slots: set[int] = set()
        self._closing = False
        self._paused = False

    async def start(self) -> None:
        for slot in range(self._prefetch):
            await self._start_slot(slot)

    async def _start_slot(self, slot: int) -> None:
        self._tags[slot] = await self._queue.consume(functools.partial(self._on_message, slot))

    async def _on_message(self, slot: int, message: AbstractIncomingMessage) -> None:
        if self._closing:
            return  # left unacked: closing the channel requeues it
        task = asyncio.create_task(self._process(slot, message), name=f"handle:{self._queue.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _process(self, slot: int, message: AbstractIncomingMessage) -> None:
        delivery = self._bus._delivery(message)
        held = _Held(message)
        self._held.add(held)
        self._busy_slots.add(slot)
        renewal = self._bus.lease_renewal
        keeper = asyncio.create_task(self._keep_held(slot, held, renewal)) if renewal else None
        try:
            error: Exception | None = None
            try:
                await self._handler(delivery)
            except Exception as e:
                if self._closing or _cancelling():
                    log.warning("%s failed while stopping; left unacked: %s", delivery.routing_key, e)
                    return
                error = e
            async with held.lock:
                held.active = False
            outcome, reason = judge(error, delivery, self._queue.name, log)
            if outcome is Outcome.REQUEUE and isinstance(error, Retryable):
                # A dependency is down: do not spin on it.
                await asyncio.sleep(self._bus.retry_delay)
            await self._settle(held, delivery, outcome, reason)
        finally:
            self._held.discard(held)
            self._busy_slots.discard(slot)
            if keeper is not None:
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)
        if not self._closing and not self._paused and self._tags.get(slot) is None:
            try:
                await self._start_slot(slot)
            except Exception as e:
                log.error("could not restart a consumer on %s: %s", self._queue.name, e)

    async def _settle(self, held: _Held, delivery: Delivery, outcome: Outcome, reason: str | None) -> None:
        if held.lost:
            log.warning("%s was already returned to %s by the broker", delivery.routing_key, self._queue.name)
            return
        message = held.message
        try:
            if outcome is Outcome.ACK:
                await message.ack()
            elif outcome is Outcome.REQUEUE:
                if held.hold is None:
                    await message.nack(requeue=True)
                else:
                    copy = self._bus._copy(message, delivery.routing_key)
                    await self._bus._send("", self._queue.name, copy)
                    await message.ack()
            else:
                await self._bus._dead_letter(delivery, reason or "")
                await message.ack()
        except _TRANSIENT as e:
            log.warning(
                "could not settle %s on %s (%s); the broker returns it to the queue",
                delivery.routing_key, self._queue.name, e,
            )
            return
        except Exception as e:
            # Say, the dead-letter queue was deleted: hand the message back rather than sit on it.
            log.error("could not settle %s on %s: %s; requeued", delivery.routing_key, self._queue.name, e)
            with contextlib.suppress(Exception):
                await message.nack(requeue=True)
            return
        if held.hold is not None:
            await self._bus._delete_queue(held.hold.name)

    async def _keep_held(self, slot: int, held: _Held, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            async with held.lock:
                if not held.active:
                    return
                try:
                    await self._renew(slot, held)
                except Exception as e:
                    log.error("could not re-hold a delivery on %s: %s", self._queue.name, e)
                if held.lost:
                    return

    async def _renew(self, slot: int, held: _Held) -> None:
        """Swap the held delivery for a fresh copy from the hold queue, then ack the old one."""
        bus, old = self._bus, held.message
        try:
            old.channel  # noqa: B018 - raises if the channel that delivered it has closed
        except ChannelInvalidStateError:
            held.lost = True
            return
        delivery = bus._delivery(old)
        if held.hold is None:
            held.hold = await bus._declare_hold(self._channel, self._queue.name)
        await bus._send("", held.hold.name, bus._copy(old, delivery.routing_key))
        fresh = await held.hold.get(no_ack=False, fail=False, timeout=10)
        if fresh is None:
            log.error("the held copy of %s expired before it was fetched", delivery.routing_key)
            return
        tag = self._tags.get(slot)
        if tag is not None:
            # Acking the original would give this consumer credit for another message.
            await self._queue.cancel(tag)
            self._tags[slot] = None
        held.message = fresh
        await old.ack()
        log.debug("re-held %s on %s through %s", delivery.routing_key, self._queue.name, held.hold.name)

    async def pause(self) -> None:
        """Cancel the consumers (deliveries being handled stay unacked, to be settled as usual)."""
        self._paused = True
        for slot, tag in list(self._tags.items()):
            if tag is not None:
                self._tags[slot] = None
                with contextlib.suppress(Exception):
                    await self._queue.cancel(tag)

    async def resume(self) -> None:
        """Start a consumer again for each slot not handling a delivery (a busy one restarts its own)."""
        if not self._paused:
            return
        self._paused = False
        for slot in range(self._prefetch):
            if self._closing:
                return
            if self._tags.get(slot) is None and slot not in self._busy_slots:
                await self._start_slot(slot)

    async def cancel(self) -> None:
        if self._closing:
            return
        self._closing = True
        for tag in [t for t in self._tags.values() if t is not None]:
            with contextlib.suppress(Exception):
                await self._queue.cancel(tag)
        for held in list(self._held):
            async with held.lock:
                held.active = False
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._channel.close()
        self._bus._subscriptions.discard(self)


class RabbitBus(Bus):
    """The bus on RabbitMQ through aio-pika, reconnecting by itself after a broker restart."""

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
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractRobustChannel | None = None
        self._exchange: AbstractRobustExchange | None = None
        self._subscriptions: set[_RabbitSubscription] = set()
        self._queues: set[str] = set()

    def queue_name(self, name: str) -> str:
        """The broker's name for a logical queue."""
        return f"{self.exchange}.{name}"

    async def connect(self) -> None:
        if self._connection is not None:
            return
        try:
            self._connection = await aio_pika.connect_robust(
                self.url,
                client_properties={"connection_name": self.connection_name},
                timeout=10,
                reconnect_interval=self.reconnect_interval,
            )
        except (TimeoutError, OSError, AMQPConnectionError) as e:
            raise ConnectionError(
                f"cannot reach RabbitMQ at {_where(self.url)}: {e or type(e).__name__};"
                " check APIARY_BUS_URL and that the broker is running"
            ) from e
        self._channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        self._exchange = await self._channel.declare_exchange(
            self.exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        await self.declare_queue(DEAD_LETTER_QUEUE, [])

    async def close(self) -> None:
        for sub in list(self._subscriptions):
            await sub.cancel()
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
        self._connection = self._channel = self._exchange = None

    def _require(self) -> tuple[AbstractRobustChannel, AbstractRobustExchange]:
        if self._channel is None or self._exchange is None:
            raise RuntimeError("RabbitBus is not connected: call connect() first")
        return self._channel, self._exchange

    async def declare_queue(self, name: str, bindings: Sequence[str], *, expires: float | None = None,
                            reroute: Reroute | None = None) -> None:
        channel, exchange = self._require()
        arguments: dict[str, Any] = {}
        if expires is not None:
            arguments["x-expires"] = max(1, round(expires * 1000))
        if reroute is not None:
            # RabbitMQ expires a message only at the head of its queue: fine for these queues, whose
            # messages all wait the same time.
            arguments.update({"x-message-ttl": max(1, round(reroute.after * 1000)),
                              "x-dead-letter-exchange": self.exchange, "x-dead-letter-routing-key": reroute.to})
        queue = await channel.declare_queue(self.queue_name(name), durable=True, arguments=arguments or None)
        self._queues.add(queue.name)
        for pattern in bindings:
            await queue.bind(exchange, pattern)

    async def _publish(self, message: Delivery, delay: float | None) -> None:
        routing_key = message.routing_key
        amqp = aio_pika.Message(
            body=message.body,
            headers=message.headers,
            content_type=message.content_type,
            message_id=message.message_id or uuid.uuid4().hex,
            delivery_mode=_PERSISTENT,
        )
        try:
            if delay is not None:
                await self._send("", await self._declare_delay(routing_key, delay), amqp)
            else:
                await self._send(self.exchange, routing_key, amqp)
        except TypeError as e:
            raise ValueError(
                f"message for {routing_key!r} cannot be sent over AMQP: {e}"
                " (header values must be str, int, float, bool, None, or lists and dicts of them)"
            ) from e

    async def _declare_delay(self, routing_key: str, delay: float) -> str:
        ms = max(1, round(delay * 1000))
        name = f"{self.exchange}.delay.{ms}.{routing_key}"
        if len(name.encode()) > 255:
            raise ValueError(f"delay queue name {name[:60]!r}… is over 255 bytes: use a shorter routing key")
        channel, _ = self._require()
        # Redeclared on every delayed publish: that renews x-expires, which removes the queue
        # once it has been idle well past its TTL.
        await channel.declare_queue(
            name,
            durable=True,
            robust=False,
            arguments={
                "x-message-ttl": ms,
                "x-dead-letter-exchange": self.exchange,
                "x-dead-letter-routing-key": routing_key,
                "x-expires": ms + 600_000,
            },
        )
        self._queues.add(name)
        return name

    async def _declare_hold(self, channel: AbstractRobustChannel, origin: str) -> AbstractRobustQueue:
        every = self.lease_renewal or 60.0
        ttl_ms = round(min(max(every, 1.0), 30.0) * 1000)
        name = f"{self.exchange}.hold.{uuid.uuid4().hex}"
        queue = await channel.declare_queue(
            name,
            durable=True,
            robust=False,
            arguments={
                "x-message-ttl": ttl_ms,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": origin,
                "x-expires": round((3 * every + 60) * 1000),
            },
        )
        self._queues.add(name)
        return queue

    async def _send(self, exchange_name: str, routing_key: str, message: aio_pika.Message) -> None:
        """Publish with mandatory and a confirm; wait out a reconnect up to `publish_timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.publish_timeout
        while True:
            channel, exchange = self._require()
            target = exchange if exchange_name else channel.default_exchange
            try:
                await target.publish(message, routing_key, mandatory=True, timeout=self.publish_timeout)
                return
            except PublishError as e:
                raise Unroutable(f"no queue is bound for routing key {routing_key!r}") from e
            except _TRANSIENT as e:
                left = deadline - loop.time()
                if left <= 0:
                    raise
                log.warning("publish of %s failed (%s); retrying when the broker is back", routing_key, e)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(channel.ready(), left)
                await asyncio.sleep(0.1)

    async def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        headers = {**dead_letter_headers(delivery, reason), HELD_KEY_HEADER: delivery.routing_key}
        message = aio_pika.Message(
            body=delivery.body,
            headers=headers,
            content_type=delivery.content_type,
            message_id=delivery.message_id,
            delivery_mode=_PERSISTENT,
        )
        await self._send("", self.queue_name(DEAD_LETTER_QUEUE), message)

    @staticmethod
    def _copy(message: AbstractIncomingMessage, routing_key: str) -> aio_pika.Message:
        """A copy that remembers its routing key and counts as redelivered if it comes back."""
        headers = {**(message.headers or {}), HELD_KEY_HEADER: routing_key, REDELIVERED_HEADER: True}
        return aio_pika.Message(
            body=message.body,
            headers=headers,
            content_type=message.content_type,
            message_id=message.message_id,
            delivery_mode=_PERSISTENT,
        )

    @staticmethod
    def _delivery(message: AbstractIncomingMessage) -> Delivery:
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
        )

    async def consume(self, queue: str, handler: Handler, *, prefetch: int = 16) -> Subscription:
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        name = self.queue_name(queue)
        if await self._ready_count(name) is None:
            raise ValueError(f"queue {queue!r} is not declared")
        if self._connection is None:
            raise RuntimeError("RabbitBus is not connected: call connect() first")
        channel = await self._connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=1)
        amqp_queue = await channel.declare_queue(name, passive=True)
        sub = _RabbitSubscription(self, amqp_queue, channel, handler, prefetch)
        self._subscriptions.add(sub)
        try:
            await sub.start()
        except BaseException:
            await sub.cancel()
            raise
        return sub

    async def _admin_channel(self) -> aiormq.abc.AbstractChannel:
        """A plain channel for calls that may fail with a channel error (it is thrown away)."""
        if self._connection is None:
            raise RuntimeError("RabbitBus is not connected: call connect() first")
        await self._connection.ready()
        transport = self._connection.transport
        if transport is None:
            raise ConnectionError(f"RabbitMQ at {_where(self.url)} is not connected")
        return await transport.connection.channel(publisher_confirms=False)

    async def _ready_count(self, name: str) -> int | None:
        channel = await self._admin_channel()
        try:
            ok = await channel.queue_declare(name, passive=True)
            return int(ok.message_count or 0)
        except ChannelNotFoundEntity:
            return None
        finally:
            if not channel.is_closed:
                await channel.close()

    async def purge(self, queue: str) -> int:
        channel = await self._admin_channel()
        try:
            ok = await channel.queue_purge(self.queue_name(queue))
            return int(ok.message_count or 0)
        except ChannelNotFoundEntity:
            raise ValueError(f"queue {queue!r} is not declared") from None
        finally:
            if not channel.is_closed:
                await channel.close()

    async def queue_size(self, queue: str) -> int:
        return await self._ready_count(self.queue_name(queue)) or 0

    async def _delete_queue(self, name: str) -> None:
        channel = await self._admin_channel()
        try:
            await channel.queue_delete(name)
            self._queues.discard(name)
        except Exception as e:
            log.warning("could not delete queue %s: %s", name, e)
        finally:
            if not channel.is_closed:
                await channel.close()

    async def delete_namespace(self) -> None:
        """Delete every queue this bus declared and its exchange (for tests and teardown)."""
        for sub in list(self._subscriptions):
            await sub.cancel()
        for name in sorted(self._queues | {self.queue_name(DEAD_LETTER_QUEUE)}):
            await self._delete_queue(name)
        channel = await self._admin_channel()
        try:
            await channel.exchange_delete(self.exchange)
        finally:
            if not channel.is_closed:
                await channel.close()
