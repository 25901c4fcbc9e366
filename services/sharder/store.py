"""The sharder's table (shards made per job): its migrations and every statement the sharder runs."""

from __future__ import annotations

from apiary.component import from_json, to_json
from apiary.contracts import ShardInfo
from apiary.db import Executor
from apiary.outbox import outbox_migration

# Version 1 is the schema as 0.1.0 ships it; append a step for each later change (a database records how many
# of these it has applied).
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS shards (
      job_id TEXT NOT NULL, shard BIGINT NOT NULL, storage_key TEXT NOT NULL, size BIGINT NOT NULL,
      sha256 TEXT NOT NULL, num_samples BIGINT NOT NULL, dataset_id TEXT,
      -- Each shard's label histogram (JSON, NULL where its file has none), so that a redelivered request
      -- announces the same shards.
      labels TEXT,
      created_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (job_id, shard));
    """ + outbox_migration("sharder_outbox"),
]

OUTBOX = "sharder_outbox"


async def job_shards(db: Executor, job_id: str) -> tuple[list[ShardInfo], str | None]:
    """The shards already made for a job, in order, and the registered dataset they came from."""
    rows = await db.fetch(
        "SELECT shard, storage_key, size, sha256, num_samples, dataset_id, labels FROM shards WHERE job_id = $1"
        " ORDER BY shard",
        job_id,
    )
    shards = [ShardInfo(index=r["shard"], key=r["storage_key"], size=r["size"], sha256=r["sha256"],
                        num_samples=r["num_samples"], labels=from_json(r["labels"])) for r in rows]
    return shards, rows[0]["dataset_id"] if rows else None


async def record_shards(tx: Executor, job_id: str, shards: list[ShardInfo], dataset_id: str | None,
                        now: float) -> None:
    """Remember a job's shards (once)."""
    for s in shards:
        await tx.execute(
            "INSERT INTO shards (job_id, shard, storage_key, size, sha256, num_samples, dataset_id, created_at,"
            " labels) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING",
            job_id, s.index, s.key, s.size, s.sha256, s.num_samples, dataset_id, now,
            None if s.labels is None else to_json(s.labels),
        )
