"""The operational gauges the scheduler samples while metrics are on: jobs by status, workers online by kind, how
much of its timeout the most advanced running round has spent, and the depth of the assignment pool and the
dead-letter queue. One scheduler's view; with replicas, each exports the same values (dashboards take max)."""

from __future__ import annotations

import time
from collections import Counter

from apiary import metrics
from apiary.bus import Bus
from apiary.bus.base import DEAD_LETTER_QUEUE
from apiary.bus.layout import POOL
from apiary.db import Executor
from apiary.status import JobStatus
from services.scheduler import store

KINDS = ("own", "platform", "any")  # a worker that declares no kind counts as `any`


def timeout_used(rounds: list[dict[str, float]], now: float) -> float:
    """The largest share of its timeout (start to deadline) that a running round has spent; 0 with none."""
    shares = [(now - r["started_at"]) / (r["deadline"] - r["started_at"])
              for r in rounds if r["deadline"] > r["started_at"]]
    return max([0.0, *shares])


async def sample(db: Executor, bus: Bus, online_since: float) -> None:
    """Read the gauges' values now and set them."""
    rows = await db.fetch("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")
    metrics.jobs({**{str(s): 0 for s in JobStatus}, **{r["status"]: int(r["n"]) for r in rows}})
    running = await db.fetch("SELECT started_at, deadline FROM rounds WHERE status = 'running'")
    metrics.round_timeout_used(timeout_used(running, time.time()))
    kinds = Counter(kind or "any" for kind in (await store.online_workers(db, online_since)).values())
    metrics.workers_online({**dict.fromkeys(KINDS, 0), **kinds})
    for queue in (POOL, DEAD_LETTER_QUEUE):
        metrics.queue_depth(queue, await bus.queue_size(queue))


__all__ = ["sample", "timeout_used"]
