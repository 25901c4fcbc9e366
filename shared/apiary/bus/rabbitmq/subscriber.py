"""Consuming on RabbitMQ: run the handler for each delivery, then ack, requeue or dead-letter it as `judge` says.

Concurrency: a subscription is one channel holding `prefetch` consumers (slots) of prefetch 1 each, so
re-holding a delivery can cancel that one consumer (freeing no extra broker credit) and the number of running
handlers never exceeds `prefetch`.

With `requeue_by_copy` (quorum queues, whose broker counts every return towards the delivery limit) a requeue
publishes a copy and acks the delivery, as a re-held one always does: only a consumer's death counts then.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel, AbstractRobustQueue

from apiary.bus.base import Delivery, Handler, Kept, Outcome, Retryable, Subscription, judge
from apiary.bus.rabbitmq import wire
from apiary.bus.rabbitmq.publisher import Publisher
from apiary.bus.rabbitmq.rehold import Held, Lease
from apiary.telemetry import MESSAGING_SYSTEM

log = logging.getLogger("apiary.bus.rabbitmq")


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class RabbitSubscription(Subscription):
    """The consumers of one queue on a channel of their own."""

    def __init__(
        self, queue: AbstractRobustQueue, channel: AbstractRobustChannel, handler: Handler, prefetch: int, *,
        publisher: Publisher, lease: Lease | None, retry_delay: float,
        on_cancel: Callable[[RabbitSubscription], None], keeping: Lease, requeue_by_copy: bool = False,
        reroutes: bool = False,
    ) -> None:
        self._queue, self._channel = queue, channel
        self._handler, self._prefetch = handler, prefetch
        self._publisher, self._lease, self._retry_delay = publisher, lease, retry_delay
        self._keeping = keeping  # how a delivery is kept past its handler (Delivery.keep)
        self._on_cancel = on_cancel
        self._requeue_by_copy = requeue_by_copy
        self._reroutes = reroutes
        self._tags: dict[int, str | None] = {}
        self._held: set[Held] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._busy_slots: set[int] = set()
        self._closing = False
        self._paused = False

    async def start(self) -> None:
        """Start a consumer for every slot."""
        for slot in range(self._prefetch):
            await self._start_slot(slot)

    async def _start_slot(self, slot: int) -> None:
        self._tags[slot] = await self._queue.consume(functools.partial(self._on_message, slot))

    async def _stop_slot(self, slot: int) -> None:
        tag = self._tags.get(slot)
        if tag is not None:
            await self._queue.cancel(tag)
            self._tags[slot] = None

    async def _on_message(self, slot: int, message: AbstractIncomingMessage) -> None:
        if self._closing:
            return  # left unacked: closing the channel requeues it
        task = asyncio.create_task(self._process(slot, message), name=f"handle:{self._queue.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _process(self, slot: int, message: AbstractIncomingMessage) -> None:
        delivery = wire.incoming(message, self._publisher.user)
        held = Held(message)
        delivery.keeper = functools.partial(self._keep, held)
        self._held.add(held)
        self._busy_slots.add(slot)
        keeper = None
        if self._lease is not None:
            keeper = asyncio.create_task(self._lease.keep(held, functools.partial(self._stop_slot, slot)))
        try:
            if not await self._handle(held, delivery):
                return
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

    async def _keep(self, held: Held) -> Kept:
        """`Delivery.keep`: a copy set apart, taken while no re-hold swaps the delivery."""
        async with held.lock:
            return await self._keeping.set_apart(held.message)

    async def _handle(self, held: Held, delivery: Delivery) -> bool:
        """Run the handler and settle the delivery; False if it failed while stopping (left unacked)."""
        error: Exception | None = None
        started = time.perf_counter()
        try:
            await self._handler(delivery)
        except Exception as e:
            if self._closing or _cancelling():
                log.warning("%s failed while stopping; left unacked: %s", delivery.routing_key, e)
                return False
            error = e
        await held.finish()
        outcome, reason = judge(error, delivery, self._queue.name, log, system=MESSAGING_SYSTEM, started=started)
        if outcome is Outcome.REQUEUE and isinstance(error, Retryable):
            # A dependency is down: do not spin on it.
            await asyncio.sleep(self._retry_delay)
        await self._settle(held, delivery, outcome, reason)
        return True

    async def _settle(self, held: Held, delivery: Delivery, outcome: Outcome, reason: str | None) -> None:
        if held.lost:
            log.warning("%s was already returned to %s by the broker", delivery.routing_key, self._queue.name)
            return
        try:
            await self._apply(held, delivery, outcome, reason)
        except wire.TRANSIENT as e:
            log.warning(
                "could not settle %s on %s (%s); the broker returns it to the queue",
                delivery.routing_key, self._queue.name, e,
            )
            return
        except Exception as e:
            # Say, the dead-letter queue was deleted: hand the message back rather than sit on it.
            log.error("could not settle %s on %s: %s; requeued", delivery.routing_key, self._queue.name, e)
            with contextlib.suppress(Exception):
                await held.message.nack(requeue=True)
            return
        if self._lease is not None:
            await self._lease.release(held)

    async def _apply(self, held: Held, delivery: Delivery, outcome: Outcome, reason: str | None) -> None:
        """Ack, requeue, reroute or dead-letter; a re-held delivery is requeued as a copy (its original is acked).

        A reroute is a rejection: the broker dead-letters the delivery where its queue's arguments say (the
        exchange, under `Reroute.to`), so no publish permission for that key is needed. A re-held delivery,
        rejected, goes back to its queue through the hold queue's own dead-lettering, and on from there when
        its queue's TTL runs out.
        """
        message = held.message
        if outcome is Outcome.REQUEUE and held.hold is None and not self._requeue_by_copy:
            await message.nack(requeue=True)
            return
        if outcome is Outcome.REROUTE and self._reroutes:
            await message.reject(requeue=False)
            return
        if outcome is Outcome.REQUEUE:
            await self._publisher.send("", self._queue.name, wire.held_copy(message, delivery, self._publisher.user))
        elif outcome in (Outcome.DEAD, Outcome.REROUTE):  # a queue without a reroute: dead letters
            await self._publisher.dead_letter(delivery, reason or "")
        await message.ack()

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
        """Stop consuming and close the channel: what is not settled yet goes back to the queue."""
        if self._closing:
            return
        self._closing = True
        for tag in [t for t in self._tags.values() if t is not None]:
            with contextlib.suppress(Exception):
                await self._queue.cancel(tag)
        for held in list(self._held):
            await held.finish()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._channel.close()
        self._on_cancel(self)
