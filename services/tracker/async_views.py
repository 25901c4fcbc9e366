"""What the tracker shows of async (FedBuff) jobs: each version's folded updates with their staleness (a
histogram), each worker's update rate, and the training tasks out now. Fed from events it receives anyway:
round.start (the job's async settings), round.assigned (a task: its shard row, with the digests that make its
reports judged like a round's) and round.aggregated (the updates a version folded)."""

from __future__ import annotations

import time
from typing import Any

from apiary.contracts import RoundAggregated, RoundAssigned, RoundStart
from apiary.db import Executor

COMPONENT = "tracker_async"
# Append only, as every component's migrations.
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS async_job_views (
      job_id TEXT PRIMARY KEY, buffer_size BIGINT NOT NULL, concurrency BIGINT NOT NULL,
      staleness_weight TEXT NOT NULL, max_staleness BIGINT);
    CREATE TABLE IF NOT EXISTS async_updates (
      job_id TEXT NOT NULL, version BIGINT NOT NULL, task_round BIGINT NOT NULL, task_attempt BIGINT NOT NULL,
      shard BIGINT NOT NULL, worker_id TEXT NOT NULL, samples BIGINT NOT NULL, staleness BIGINT NOT NULL,
      weight DOUBLE PRECISION NOT NULL, duration DOUBLE PRECISION NOT NULL, ts DOUBLE PRECISION NOT NULL,
      PRIMARY KEY (job_id, task_round, task_attempt, shard));
    """,
]
TASKS_SHOWN = 100  # training tasks listed for a job


async def started(tx: Executor, e: RoundStart, ts: float) -> None:
    """A version of an async job opened: its settings (once)."""
    settings = e.asynchronous
    if settings is None:
        return
    await tx.execute("INSERT INTO async_job_views (job_id, buffer_size, concurrency, staleness_weight, max_staleness)"
                     " VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING", e.job_id, settings.k, settings.slots,
                     settings.staleness_weight, settings.max_staleness)


async def assigned(tx: Executor, e: RoundAssigned, ts: float) -> None:
    """A task went out: its shard row (state assigned), carrying the digests its reports must match."""
    await tx.execute(
        "INSERT INTO shard_views (job_id, round, attempt, shard, secret_digest, progress_digest, state, updated_at)"
        " VALUES ($1, $2, $3, $4, $5, $6, 'assigned', $7) ON CONFLICT DO NOTHING",
        e.job_id, e.round, e.attempt, e.shard, e.secret_digest, e.progress_digest, ts)


async def aggregated(tx: Executor, e: RoundAggregated, ts: float) -> None:
    """A version was made: the updates it folded, each once."""
    for u in e.folded:
        await tx.execute(
            "INSERT INTO async_updates (job_id, version, task_round, task_attempt, shard, worker_id, samples,"
            " staleness, weight, duration, ts) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
            " ON CONFLICT DO NOTHING", e.job_id, e.round, u.round, u.attempt, u.shard, u.worker_id, u.samples,
            u.staleness, u.weight, u.duration_s, ts)


async def summary(db: Executor, job_id: str, now: float | None = None) -> dict[str, Any] | None:
    """An async job's versions at a glance (None for a synchronous job): its settings, the staleness histogram
    of the updates folded, each worker's updates (per minute over the job's folding time) and the tasks out."""
    job = await db.fetchrow("SELECT * FROM async_job_views WHERE job_id = $1", job_id)
    if job is None:
        return None
    updates = await db.fetch("SELECT version, worker_id, staleness, ts FROM async_updates WHERE job_id = $1",
                             job_id)
    histogram: dict[int, int] = {}
    workers: dict[str, list[int]] = {}
    for u in updates:
        histogram[int(u["staleness"])] = histogram.get(int(u["staleness"]), 0) + 1
        workers.setdefault(u["worker_id"], []).append(int(u["staleness"]))
    started = await db.fetchval("SELECT MIN(started_at) FROM round_views WHERE job_id = $1", job_id)
    last = max((float(u["ts"]) for u in updates), default=now or time.time())
    minutes = max((last - float(started or last)) / 60.0, 1e-9)
    tasks = await db.fetch(
        "SELECT round, attempt, shard, worker_id, state, updated_at FROM shard_views WHERE job_id = $1"
        " AND state IN ('assigned', 'training') ORDER BY attempt DESC LIMIT $2", job_id, TASKS_SHOWN)
    return {
        "buffer_size": job["buffer_size"], "concurrency": job["concurrency"],
        "staleness_weight": job["staleness_weight"], "max_staleness": job["max_staleness"],
        "versions": len({int(u["version"]) for u in updates}), "updates": len(updates),
        "staleness_histogram": [{"staleness": s, "count": n} for s, n in sorted(histogram.items())],
        "workers": [{"worker_id": w, "updates": len(s), "per_minute": round(len(s) / minutes, 3),
                     "mean_staleness": round(sum(s) / len(s), 3)} for w, s in sorted(workers.items())],
        "tasks": [dict(t) for t in tasks],
    }


async def latest_tasks(db: Executor, job_id: str) -> list[dict[str, Any]]:
    """Each shard's latest training task, as the job view lists a round's shards."""
    return await db.fetch(
        "SELECT s.shard, s.worker_id, s.state, s.step, s.metrics, s.error, s.updated_at, w.status AS worker_status"
        " FROM shard_views s LEFT JOIN workers w ON w.worker_id = s.worker_id WHERE s.job_id = $1 AND s.attempt ="
        " (SELECT MAX(t.attempt) FROM shard_views t WHERE t.job_id = s.job_id AND t.shard = s.shard) ORDER BY s.shard",
        job_id)
