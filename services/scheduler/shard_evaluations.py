"""A personal-layers job's evaluation, shard by shard (issue 41): each shard's personalised model (the round's global
model with the shard's personal layers) is scored on a worker where the shard's data and state are, one evaluate
assignment a shard, and the round's evaluation is their mean, weighted by each shard's `num_samples`, once every
shard's report is in (or the task's time is up: the shards still out count as failed).

The pure part (`summary`) says what the shards' reports make of the round's evaluation; the rest keeps each shard's
report, once, in the scheduler's database.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from apiary.component import from_json, to_json
from apiary.db import Executor
from apiary.jobspec import JobSpec
from services.scheduler.evaluation import DONE, FAILED, NONE, PENDING

COMPONENT = "scheduler_shard_evaluations"
# Append only, as every component's migrations.
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS shard_evaluations (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, shard BIGINT NOT NULL, status TEXT NOT NULL,
      metrics TEXT, error TEXT, worker_id TEXT, PRIMARY KEY (job_id, round, shard));
    """,
]
# The metric that weighs a shard in the mean (fl_evaluate_model's count of the samples it scored); 1 without it.
WEIGHT = "num_samples"


def by_shard(spec: JobSpec, round_index: int) -> bool:
    """Whether the round's evaluation scores each shard's personalised model (user code with personal layers)
    rather than the global model alone."""
    return spec.trainer is None and bool(spec.distributed.personal_layers) and round_index > 0


@dataclass(frozen=True)
class ShardReport:
    """One shard's evaluation as the scheduler stored it."""

    shard: int
    status: str
    metrics: dict[str, float]
    error: str | None = None
    worker_id: str | None = None


@dataclass(frozen=True)
class Summary:
    """The round's evaluation made of its shards' reports."""

    status: str
    metrics: dict[str, float]
    shards: dict[int, dict[str, float]]
    error: str | None
    workers: str


def summary(reports: Sequence[ShardReport]) -> Summary | None:
    """The round's evaluation once no shard's report is pending (None before): done with the `num_samples`-weighted
    mean of each metric every scored shard reports, where any shard was scored; else failed (the first shard's
    error) or none (the module has no fl_evaluate_model)."""
    if any(r.status == PENDING for r in reports):
        return None
    done = [r for r in reports if r.status == DONE]
    workers = ", ".join(sorted({r.worker_id for r in reports if r.worker_id}))
    failed = sorted((r for r in reports if r.status == FAILED), key=lambda r: r.shard)
    if not done:
        if failed:
            return Summary(FAILED, {}, {}, f"shard {failed[0].shard}: {failed[0].error}", workers)
        return Summary(NONE, {}, {}, None, workers)
    weights = {r.shard: float(r.metrics.get(WEIGHT, 1.0)) for r in done}
    total = sum(weights.values()) or float(len(done))
    common = set.intersection(*(set(r.metrics) for r in done))
    mean = {name: sum(weights[r.shard] * r.metrics[name] for r in done) / total for name in sorted(common - {WEIGHT})}
    if WEIGHT in common:
        mean[WEIGHT] = sum(r.metrics[WEIGHT] for r in done)
    error = "; ".join(f"shard {r.shard}: {r.error}" for r in failed) or None
    return Summary(DONE, mean, {r.shard: dict(r.metrics) for r in done}, error, workers)


async def insert(tx: Executor, job_id: str, round_index: int, shards: Sequence[int]) -> None:
    """The round's shards' evaluations are pending (again, for a retried evaluation: nothing changes)."""
    for shard in shards:
        await tx.execute("INSERT INTO shard_evaluations (job_id, round, shard, status) VALUES ($1, $2, $3, $4)"
                         " ON CONFLICT (job_id, round, shard) DO NOTHING", job_id, round_index, shard, PENDING)


async def settle(tx: Executor, job_id: str, round_index: int, shard: int, status: str, metrics: Mapping[str, float],
                 error: str | None, worker_id: str | None) -> bool:
    """Keep one shard's report, if its evaluation was pending; whether it was (a redelivery changes nothing)."""
    now = await tx.fetchval("SELECT status FROM shard_evaluations WHERE job_id = $1 AND round = $2 AND shard = $3",
                            job_id, round_index, shard)
    if now != PENDING:
        return False
    await tx.execute("UPDATE shard_evaluations SET status = $4, metrics = $5, error = $6, worker_id = $7"
                     " WHERE job_id = $1 AND round = $2 AND shard = $3",
                     job_id, round_index, shard, status, to_json(dict(metrics)), error, worker_id)
    return True


async def give_up(tx: Executor, job_id: str, round_index: int, why: str) -> None:
    """The shards whose report is still out count as failed, for `why`."""
    await tx.execute("UPDATE shard_evaluations SET status = $3, error = $4 WHERE job_id = $1 AND round = $2"
                     " AND status = $5", job_id, round_index, FAILED, why, PENDING)


async def reports(db: Executor, job_id: str, round_index: int) -> list[ShardReport]:
    """The round's shards' evaluations, by shard."""
    rows = await db.fetch("SELECT shard, status, metrics, error, worker_id FROM shard_evaluations"
                          " WHERE job_id = $1 AND round = $2 ORDER BY shard", job_id, round_index)
    return [ShardReport(int(r["shard"]), r["status"], from_json(r["metrics"], {}) or {}, r["error"], r["worker_id"])
            for r in rows]


def as_dict(s: Summary) -> dict[str, Any]:
    """The summary's fields a `round.evaluated` carries."""
    return {"metrics": s.metrics, "shards": s.shards, "error": s.error if s.status == FAILED else None,
            "found": s.status != NONE}
