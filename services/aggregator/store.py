"""The aggregator's tables: their migrations and every SQL statement it runs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from apiary import telemetry
from apiary.component import to_json
from apiary.contracts import ObjectRef, RoundStart, WorkerDone, WorkerFailed
from apiary.db import Database, Executor
from apiary.outbox import outbox_migration
from apiary.status import ContributionStatus, RoundStatus

# Version 1 is the schema as 0.1.0 ships it; append a step for each later change (a database records how many
# of these it has applied).
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS aggregations (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL, shards TEXT NOT NULL,
      min_workers BIGINT NOT NULL, weights_key TEXT NOT NULL, weights_size BIGINT NOT NULL,
      weights_sha256 TEXT NOT NULL, status TEXT NOT NULL,
      result_key TEXT, reason TEXT, opened_at DOUBLE PRECISION NOT NULL, closed_at DOUBLE PRECISION,
      -- The round's trace context (the parent of the aggregation span, NULL where none was current).
      traceparent TEXT,
      -- The round's deadline: a last shard settling after it ends the round as a timeout would.
      deadline DOUBLE PRECISION NOT NULL,
      -- The round's update format, strategy and the strategy's parameters (JSON).
      update_format TEXT NOT NULL, strategy TEXT NOT NULL, strategy_params TEXT NOT NULL,
      -- Central differential privacy around the strategy (JSON of apiary.privacy.DifferentialPrivacy; NULL: none).
      privacy TEXT,
      -- Where the strategy's server state after the round is stored (NULL: it keeps none).
      state_key TEXT,
      -- Each shard's assignment-secret digest (JSON, shard -> digest).
      secret_digests TEXT NOT NULL,
      -- How many shards have settled (by any replica), kept with each settling report in the same transaction:
      -- closing a round reads one row rather than counting its contributions after each one (K^2 a round).
      settled BIGINT NOT NULL DEFAULT 0,
      -- Secure aggregation of the round (JSON: the job's settings and each shard's verify key; NULL: none).
      secagg TEXT,
      PRIMARY KEY (job_id, round, attempt));
    CREATE TABLE IF NOT EXISTS contributions (
      seq {autoid}, job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL,
      shard BIGINT NOT NULL, worker_id TEXT NOT NULL, status TEXT NOT NULL, reason TEXT,
      samples BIGINT NOT NULL, result_key TEXT NOT NULL, size BIGINT NOT NULL, sha256 TEXT NOT NULL,
      metrics TEXT NOT NULL, received_at DOUBLE PRECISION NOT NULL,
      -- The report's trace context (a link of the aggregation span, NULL where none was current).
      traceparent TEXT);
    CREATE UNIQUE INDEX IF NOT EXISTS contributions_once
      ON contributions (job_id, round, attempt, shard) WHERE status IN ('accepted', 'rejected', 'failed');
    CREATE INDEX IF NOT EXISTS contributions_round ON contributions (job_id, round, attempt);
    -- Secure aggregation's key agreement as it came: each shard's keys, shares and reveal, and the stages the
    -- aggregator moved to (shard -1), so a restarted aggregator takes the round up where it was.
    CREATE TABLE IF NOT EXISTS secagg_messages (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL, shard BIGINT NOT NULL,
      kind TEXT NOT NULL, body TEXT NOT NULL, received_at DOUBLE PRECISION NOT NULL,
      PRIMARY KEY (job_id, round, attempt, shard, kind));
    """ + outbox_migration("aggregator_outbox"),
]

COLUMNS = ("job_id", "round", "attempt", "shards", "min_workers", "weights_key", "weights_size", "weights_sha256",
           "status", "opened_at", "traceparent", "deadline", "update_format", "strategy", "strategy_params",
           "privacy", "secret_digests", "secagg")


def opened_row(event: RoundStart) -> dict[str, Any]:
    """The aggregations row of a round that starts now, as `fetch` would return it."""
    return {
        "job_id": event.job_id, "round": event.round, "attempt": event.attempt, "shards": to_json(event.shards),
        "min_workers": event.min_workers, "weights_key": event.weights.key, "weights_size": event.weights.size,
        "weights_sha256": event.weights.sha256, "status": str(RoundStatus.OPEN), "opened_at": time.time(),
        "traceparent": telemetry.headers_for().get("traceparent"), "deadline": event.deadline,
        "update_format": str(event.update_format), "strategy": event.strategy,
        "strategy_params": to_json(event.strategy_params),
        "privacy": None if event.differential_privacy is None else event.differential_privacy.model_dump_json(),
        "secret_digests": to_json({str(shard): d for shard, d in event.secret_digests.items()}),
        "secagg": None if event.secure_aggregation is None else to_json(
            {"settings": event.secure_aggregation.model_dump(mode="json"),
             "verify_keys": {str(shard): key for shard, key in event.secagg_verify_keys.items()}}),
        "result_key": None, "reason": None, "closed_at": None, "settled": 0,
    }


_INSERT_CONTRIBUTION = (
    "INSERT INTO contributions (job_id, round, attempt, shard, worker_id, status, reason, samples,"
    " result_key, size, sha256, metrics, received_at, traceparent)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"
)

# A settling report whose shard has settled already (contributions_once) is kept as a duplicate instead.
_INSERT_SETTLING = (_INSERT_CONTRIBUTION + " ON CONFLICT (job_id, round, attempt, shard)"
                    " WHERE status IN ('accepted', 'rejected', 'failed') DO NOTHING")
# Raises a round attempt's settled-shard count by $4 in the transaction that stores those reports; the new count.
_COUNT_SETTLED = ("UPDATE aggregations SET settled = settled + $4 WHERE job_id = $1 AND round = $2 AND attempt = $3"
                  " RETURNING settled")


def contribution_row(event: WorkerDone | WorkerFailed, status: ContributionStatus,
                     reason: str | None) -> tuple[Any, ...]:
    """A report's contributions row (the values of _INSERT_CONTRIBUTION), received now, in the current span."""
    if isinstance(event, WorkerFailed):
        samples, result, metrics = 0, ObjectRef(key="", size=0, sha256=""), {}
    else:
        samples, result, metrics = event.samples, event.result, event.metrics
    return (event.job_id, event.round, event.attempt, event.shard, event.worker_id, str(status), reason,
            samples, result.key, result.size, result.sha256, to_json(metrics), time.time(),
            telemetry.headers_for().get("traceparent"))


class AggregatorStore:
    """The aggregations (one row per round attempt) and contributions (one per report) tables."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def migrate(self, component: str) -> None:
        """Create or update the tables."""
        await self.db.migrate(component, MIGRATIONS)

    async def open_round(self, row: dict[str, Any]) -> bool:
        """Store a round that starts; False when it was stored already (a redelivered round.start)."""
        values = [row[c] for c in COLUMNS]
        placeholders = ", ".join(f"${i}" for i in range(1, len(COLUMNS) + 1))
        inserted = await self.db.execute(
            f"INSERT INTO aggregations ({', '.join(COLUMNS)}) VALUES ({placeholders}) ON CONFLICT DO NOTHING",
            *values,
        )
        return bool(inserted)

    async def aggregation(self, job_id: str, round_index: int, attempt: int) -> dict[str, Any] | None:
        """A round attempt's row, or None if it never started here."""
        return await self.db.fetchrow(
            "SELECT * FROM aggregations WHERE job_id = $1 AND round = $2 AND attempt = $3",
            job_id, round_index, attempt,
        )

    async def contributions(self, job_id: str, round_index: int, attempt: int) -> list[dict[str, Any]]:
        """Every report recorded for a round attempt, in arrival order."""
        return await self.db.fetch(
            "SELECT * FROM contributions WHERE job_id = $1 AND round = $2 AND attempt = $3 ORDER BY seq",
            job_id, round_index, attempt,
        )

    async def record(self, event: WorkerDone | WorkerFailed, status: ContributionStatus,
                     reason: str | None) -> int | None:
        """Store one report with what became of it; for one that settles its shard, how many shards of the
        round attempt have settled now, by any aggregator replica (counted in the same transaction)."""
        row = contribution_row(event, status, reason)
        if not status.settles:
            await self.db.execute(_INSERT_CONTRIBUTION, *row)
            return None
        async with self.db.transaction() as tx:
            await tx.execute(_INSERT_CONTRIBUTION, *row)
            settled = await tx.fetchval(_COUNT_SETTLED, event.job_id, event.round, event.attempt, 1)
        return None if settled is None else int(settled)

    async def record_settling(self, key: tuple[str, int, int], rows: Sequence[tuple[Any, ...]]) -> int | None:
        """Store reports that settle their shards of one round attempt (`contribution_row`s) in one transaction
        (services/aggregator/recording.py); how many of its shards have settled now, by any aggregator replica."""
        async with self.db.transaction() as tx:
            stored = 0
            for row in rows:
                if await tx.execute(_INSERT_SETTLING, *row):
                    stored += 1
                else:  # another aggregator replica settled the shard meanwhile (the report came to both)
                    status, reason = str(ContributionStatus.DUPLICATE), "shard already settled by another replica"
                    await tx.execute(_INSERT_CONTRIBUTION, *row[:5], status, reason, *row[7:])
            settled = await tx.fetchval(_COUNT_SETTLED, *key, stored)
        return None if settled is None else int(settled)

    async def settled_shards(self, job_id: str, round_index: int, attempt: int) -> int:
        """How many shards of a round attempt have settled, by any aggregator replica."""
        settled = await self.db.fetchval(
            "SELECT settled FROM aggregations WHERE job_id = $1 AND round = $2 AND attempt = $3",
            job_id, round_index, attempt,
        )
        return int(settled or 0)

    async def keep_secagg(self, key: tuple[str, int, int], shard: int, kind: str, body: str) -> bool:
        """Store one message (or stage) of a round's key agreement, once; whether this call stored it (False: it
        was stored already, by this aggregator or another replica)."""
        return bool(await self.db.execute(
            "INSERT INTO secagg_messages (job_id, round, attempt, shard, kind, body, received_at)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING", *key, shard, kind, body, time.time()))

    async def refused_shards(self, job_id: str, round_index: int, attempt: int) -> set[int]:
        """The shards of a round attempt that settled without a contribution (failed or rejected), by any
        aggregator replica."""
        rows = await self.db.fetch(
            "SELECT shard FROM contributions WHERE job_id = $1 AND round = $2 AND attempt = $3"
            " AND status IN ($4, $5)", job_id, round_index, attempt, str(ContributionStatus.FAILED),
            str(ContributionStatus.REJECTED))
        return {int(r["shard"]) for r in rows}

    async def secagg_messages(self, job_id: str, round_index: int, attempt: int) -> list[dict[str, Any]]:
        """A round's key agreement as stored, in the order it came."""
        return await self.db.fetch(
            "SELECT shard, kind, body, received_at FROM secagg_messages WHERE job_id = $1 AND round = $2"
            " AND attempt = $3 ORDER BY received_at, shard", job_id, round_index, attempt)

    async def previous_state_key(self, job_id: str, round_index: int) -> str | None:
        """Where the strategy's server state after the job's last aggregated round before this one is stored."""
        row = await self.db.fetchrow(
            "SELECT state_key FROM aggregations WHERE job_id = $1 AND round < $2 AND status = $3"
            " ORDER BY round DESC LIMIT 1",
            job_id, round_index, str(RoundStatus.AGGREGATED),
        )
        return row["state_key"] if row is not None else None

    @staticmethod
    async def close(tx: Executor, key: tuple[str, int, int], status: RoundStatus, *, reason: str | None = None,
                    result_key: str | None = None, state_key: str | None = None) -> bool:
        """Mark an open round attempt aggregated (with its result and the strategy's state) or failed (with
        the reason), in `tx`; False if it was no longer open (another aggregator replica closed it)."""
        changed = await tx.execute(
            "UPDATE aggregations SET status = $4, reason = $5, result_key = $6, closed_at = $7, state_key = $8"
            " WHERE job_id = $1 AND round = $2 AND attempt = $3 AND status = $9",
            *key, str(status), reason, result_key, time.time(), state_key, str(RoundStatus.OPEN),
        )
        return changed > 0

    async def end_job(self, job_id: str, status: RoundStatus, reason: str) -> int:
        """Close a job's open rounds as cancelled or failed; how many were open."""
        return await self.db.execute(
            "UPDATE aggregations SET status = $2, reason = $3, closed_at = $4 WHERE job_id = $1 AND status = $5",
            job_id, str(status), reason, time.time(), str(RoundStatus.OPEN),
        )
