"""Whose turn the worker's slot is: a shard pinned to this worker or preferred here (it trained it last round)
goes before the pool's; a preferred one that finds the slot busy goes to the pool at once, for any worker."""

from __future__ import annotations

import logging

from apiary.assignments import (
    POOL,
    PREFERRED,
    PREFERRED_PREFETCH,
    PREFERRED_QUEUE_EXPIRES,
    pinned_queue,
    preferred_queue,
)
from apiary.bus import Bus, Decline, Delivery, EventHandler, PassOn, Subscription, subscribe
from apiary.bus.typed import Middleware, Next
from apiary.contracts import Assignment
from services.worker.slot import Slot

log = logging.getLogger("apiary.worker")


class QueueTurns:
    """The worker's three assignment queues (pinned, preferred, pool), each taking its turn at the slot."""

    def __init__(self, worker_id: str, slot: Slot) -> None:
        self._worker_id, self._slot = worker_id, slot
        self._subscriptions: list[Subscription] = []  # pinned, preferred, pool
        self._pool: Subscription | None = None
        self._dedicated = 0  # pinned or preferred shards training or waiting to, here

    async def subscribe(self, bus: Bus, handler: EventHandler, prefetch: int, then: list[Middleware]) -> None:
        """Take assignments from the three queues into `handler`, each queue's turn first, then `then`."""
        own = pinned_queue(self._worker_id)
        self._subscriptions.append(await subscribe(bus, own, {own: handler}, prefetch=prefetch,
                                                   middleware=[self.dedicated_turn, *then]))
        preferred = preferred_queue(self._worker_id)
        self._subscriptions.append(await subscribe(
            bus, preferred, {preferred: handler}, prefetch=PREFERRED_PREFETCH,
            expires=PREFERRED_QUEUE_EXPIRES, reroute=PREFERRED, middleware=[self.preferred_turn, *then],
        ))
        self._pool = await subscribe(bus, POOL, {POOL: handler}, prefetch=prefetch,
                                     middleware=[self.pool_turn, *then])
        self._subscriptions.append(self._pool)

    async def cancel(self) -> None:
        """Stop taking assignments; one in progress goes back to its queue."""
        self._pool = None
        for sub in self._subscriptions:
            await sub.cancel()
        self._subscriptions.clear()

    async def preferred_turn(self, assignment: Assignment, delivery: Delivery, call_next: Next) -> None:
        """A shard this worker trained last round (its data is cached here): train it, unless busy;
        then it goes to the pool at once, for any worker (rejected: the broker moves it where the preferred
        queue reroutes, so a worker needs no permission to publish to the pool)."""
        if self._slot.busy:
            log.info("worker %s: busy, round %d shard %d of job %s passed to the pool", self._worker_id,
                     assignment.round, assignment.shard, assignment.job_id)
            raise PassOn(f"worker {self._worker_id} is busy")
        await self.dedicated_turn(assignment, delivery, call_next)

    async def pool_turn(self, assignment: Assignment, delivery: Delivery, call_next: Next) -> None:
        """A shard for any worker: train it when the slot is free, unless a shard meant for this worker
        trains or waits here."""
        if self._dedicated and self._pool is not None:
            # The pool's free slot took this while a pinned or preferred shard trains here (or waits to):
            # rather than hold it until then, while another worker may be idle, stop taking from the
            # pool and give it back.
            await self._pool.pause()
            raise Decline(f"worker {self._worker_id} is training a shard meant for it")
        async with self._slot.held():
            await call_next()

    async def dedicated_turn(self, assignment: Assignment, delivery: Delivery, call_next: Next) -> None:
        """The training slot, for a pinned or preferred shard (only this worker may train a pinned
        one): until it is done, pool assignments reaching this worker are declined; then the pool is
        read again."""
        self._dedicated += 1
        try:
            async with self._slot.held():
                await call_next()
        finally:
            self._dedicated -= 1
            if not self._dedicated and self._pool is not None:
                await self._pool.resume()  # if a pool assignment paused it meanwhile
