"""The in-process bus: the same topic, ack and dead-letter behaviour as RabbitMQ, in memory."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from apiary.bus.base import (
    DEAD_LETTER_QUEUE,
    Bus,
    Delivery,
    Handler,
    Outcome,
    Reroute,
    Subscription,
    Unroutable,
    dead_letter_headers,
    judge,
    topic_matches,
)

log = logging.getLogger("apiary.bus.memory")


@dataclass
class _Queue:
    name: str
    bindings: list[str]
    ready: deque[Delivery] = field(default_factory=deque)
    unacked: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    expires: float | None = None
    reroute: Reroute | None = None
    consumers: int = 0
    unused_since: float = 0.0


class _MemorySubscription(Subscription):
    def __init__(self, bus: MemoryBus, queue: _Queue, handler: Handler, prefetch: int) -> None:
        self._bus, self._queue, self._handler, self._prefetch = bus, queue, handler, prefetch
        self._inflight: dict[asyncio.Task[None], Delivery] = {}
        self._slots = asyncio.Semaphore(prefetch)
        self._paused = False
        self._loop_task = asyncio.create_task(self._run(), name=f"consume:{queue.name}")

    async def _run(self) -> None:
        queue = self._queue
        while True:
            await self._slots.acquire()
            async with queue.changed:
                await queue.changed.wait_for(lambda: bool(queue.ready) and not self._paused)
                delivery = queue.ready.popleft()
                queue.unacked += 1
            task = asyncio.create_task(self._handle(delivery))
            self._inflight[task] = delivery

    async def _handle(self, delivery: Delivery) -> None:
        error: BaseException | None = None
        started = time.perf_counter()
        try:
            await self._handler(delivery)
        except asyncio.CancelledError:
            # The consumer went away before acking: the message goes back, as on a dropped channel.
            await self._bus._settle(self._queue, delivery, Outcome.REQUEUE, None)
            raise
        except Exception as e:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # Failing while being cancelled is still being cancelled: the message goes back.
                await self._bus._settle(self._queue, delivery, Outcome.REQUEUE, None)
                return
            error = e
        outcome, reason = judge(error, delivery, self._queue.name, log, system=self._bus.system, started=started)
        await self._bus._settle(self._queue, delivery, outcome, reason)
        self._inflight.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        self._slots.release()

    async def pause(self) -> None:
        self._paused = True

    async def resume(self) -> None:
        self._paused = False
        await self._bus._notify(self._queue)

    async def cancel(self) -> None:
        self._loop_task.cancel()
        tasks = list(self._inflight)
        for task in tasks:
            task.cancel()
        for task in [self._loop_task, *tasks]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._inflight.clear()
        self._bus._subscriptions.discard(self)
        self._queue.consumers -= 1
        self._bus._unused(self._queue)


class MemoryBus(Bus):
    """An in-memory topic exchange for running every service in one process."""

    def __init__(self, user: str | None = None) -> None:
        self.user = user  # stamped as the user_id of what this bus publishes
        self._queues: dict[str, _Queue] = {}
        self._subscriptions: set[_MemorySubscription] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._ids = itertools.count(1)
        self._settled = asyncio.Event()

    def as_user(self, user: str) -> MemoryBus:
        """This bus as another process would use it: the same queues, its messages stamped `user_id=user`
        (as RabbitMQ stamps a connection's user), so one process can play several broker users."""
        other = copy.copy(self)  # shares the queues, subscriptions and timers
        other.user = user
        return other

    async def connect(self) -> None:
        await self.declare_queue(DEAD_LETTER_QUEUE, [])
        await self.declare_layout()

    async def close(self) -> None:
        for sub in list(self._subscriptions):
            await sub.cancel()
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    async def declare_queue(self, name: str, bindings: Sequence[str], *, expires: float | None = None,
                            reroute: Reroute | None = None) -> None:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = _Queue(name, list(bindings), expires=expires, reroute=reroute)
        else:
            queue.bindings.extend(b for b in bindings if b not in queue.bindings)
        self._unused(queue)

    def _unused(self, queue: _Queue) -> None:
        """A queue with `expires` that has no consumer now: delete it if it still has none by then."""
        expires = queue.expires
        if expires is None or queue.consumers:
            return
        loop = asyncio.get_running_loop()
        queue.unused_since = loop.time()
        timer: asyncio.TimerHandle

        def expire() -> None:
            self._timers.discard(timer)
            unused = loop.time() - queue.unused_since
            if self._queues.get(queue.name) is queue and not queue.consumers and unused >= expires - 1e-3:
                del self._queues[queue.name]

        timer = loop.call_later(expires, expire)
        self._timers.add(timer)

    async def _publish(self, message: Delivery, delay: float | None) -> None:
        delivery = replace(message, message_id=message.message_id or f"m{next(self._ids)}", user_id=self.user)
        if delay is not None:
            loop = asyncio.get_running_loop()
            timer: asyncio.TimerHandle

            def fire() -> None:
                self._timers.discard(timer)
                if not self._route(delivery):
                    log.error("delayed %s matched no queue and was dropped", delivery.routing_key)

            timer = loop.call_later(delay, fire)
            self._timers.add(timer)
            return
        if not self._route(delivery):
            raise Unroutable(f"no queue is bound for routing key {delivery.routing_key!r}")

    def _route(self, delivery: Delivery) -> bool:
        targets = [
            q for q in self._queues.values()
            if any(topic_matches(b, delivery.routing_key) for b in q.bindings)
        ]
        for queue in targets:
            self._push(queue, replace(delivery, headers=dict(delivery.headers)), front=False)
        return bool(targets)

    def _push(self, queue: _Queue, delivery: Delivery, *, front: bool) -> None:
        if front:
            queue.ready.appendleft(delivery)
        else:
            queue.ready.append(delivery)
        asyncio.get_running_loop().create_task(self._notify(queue))
        if queue.reroute is not None:
            loop, reroute = asyncio.get_running_loop(), queue.reroute
            timer: asyncio.TimerHandle

            def expire() -> None:
                self._timers.discard(timer)
                for i, waiting in enumerate(queue.ready):
                    if waiting is delivery:  # not taken by a consumer in time
                        del queue.ready[i]
                        self._reroute(queue, reroute, delivery)
                        return

            timer = loop.call_later(reroute.after, expire)
            self._timers.add(timer)

    def _reroute(self, queue: _Queue, reroute: Reroute, delivery: Delivery) -> None:
        """Publish a message of `queue` again under `reroute.to`, a fresh delivery there (as the broker's
        dead-lettering does)."""
        moved = replace(delivery, routing_key=reroute.to, redelivered=False)
        if not self._route(moved):
            log.error("%s from %s matched no queue under %s and was dropped", delivery.routing_key, queue.name,
                      reroute.to)

    async def _notify(self, queue: _Queue) -> None:
        async with queue.changed:
            queue.changed.notify_all()

    async def _settle(self, queue: _Queue, delivery: Delivery, outcome: Outcome, reason: str | None) -> None:
        queue.unacked -= 1
        if outcome is Outcome.REQUEUE:
            self._push(queue, replace(delivery, redelivered=True), front=True)
        elif outcome is Outcome.REROUTE and queue.reroute is not None:
            self._reroute(queue, queue.reroute, delivery)
        elif outcome in (Outcome.DEAD, Outcome.REROUTE):
            dead = replace(delivery, headers=dead_letter_headers(delivery, reason or ""), redelivered=False)
            self._push(self._queues[DEAD_LETTER_QUEUE], dead, front=False)

    async def consume(self, queue: str, handler: Handler, *, prefetch: int = 16) -> Subscription:
        if queue not in self._queues:
            raise ValueError(f"queue {queue!r} is not declared")
        sub = _MemorySubscription(self, self._queues[queue], handler, prefetch)
        self._subscriptions.add(sub)
        self._queues[queue].consumers += 1
        return sub

    async def purge(self, queue: str) -> int:
        q = self._queues[queue]
        count = len(q.ready)
        q.ready.clear()
        return count

    async def queue_size(self, queue: str) -> int:
        q = self._queues.get(queue)
        return len(q.ready) if q else 0

    def dead_letters(self) -> list[Delivery]:
        """The messages in the dead-letter queue, oldest first (for tests and the CLI)."""
        return list(self._queues[DEAD_LETTER_QUEUE].ready)

    async def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no queue with a consumer has ready or unacked messages (for tests)."""
        consumed = {sub._queue.name for sub in self._subscriptions}

        def idle() -> bool:
            return all(
                not q.ready and q.unacked == 0 for q in self._queues.values() if q.name in consumed
            )

        async with asyncio.timeout(timeout):
            while not idle():  # noqa: ASYNC110 - polling with a deadline is this helper's whole job
                await asyncio.sleep(0.005)
