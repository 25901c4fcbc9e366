"""Where a shard's assignment is queued: the queue of the worker it is pinned to, the queue of the
worker that trained it last round (which has its data cached), or the pool shared by all workers.

A preferred assignment goes to the pool if its worker has not taken it within `PREFER_WAIT` seconds
(gone, or its queue has not been read yet) and the worker passes it on at once if it is busy, so
preferring a worker never leaves a shard waiting on it. The scheduler and the worker declare a
preferred queue alike, through `preferred_queue`.
"""

from __future__ import annotations

from apiary.bus import Bus, Reroute

POOL = "assign.pool"
PREFER_WAIT = 2.0
PREFERRED_QUEUE_EXPIRES = 3600.0  # a worker gone this long loses its queue (its messages left long before)
PREFERRED = Reroute(after=PREFER_WAIT, to=POOL)
# A worker takes this many preferred assignments at once: it trains one and passes the others to the
# pool at once (more wait in its queue until PREFER_WAIT sends them there).
PREFERRED_PREFETCH = 4


def pinned_queue(worker_id: str) -> str:
    """The queue of shards pinned to one worker (their data lives with it)."""
    return f"assign.worker.{worker_id}"


def preferred_queue(worker_id: str) -> str:
    """The queue of shards one worker trained last round."""
    return f"assign.prefer.{worker_id}"


async def declare_preferred(bus: Bus, worker_id: str) -> str:
    """Declare a worker's preferred queue (bound to its own name); return the name."""
    name = preferred_queue(worker_id)
    await bus.declare_queue(name, [name], expires=PREFERRED_QUEUE_EXPIRES, reroute=PREFERRED)
    return name
