"""The scheduler's tables (jobs, rounds, worker presence, early cancels): their migrations and every
statement the scheduler runs on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from apiary.component import from_json, to_json
from apiary.contracts import ObjectRef, ShardInfo
from apiary.db import Executor
from apiary.jobspec import JobSpec
from apiary.outbox import outbox_migration
from apiary.status import JobStatus

# Version 1 is the schema as 0.1.0 ships it; append a step for each later change (a database records how many
# of these it has applied).
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS jobs (
      job_id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL, status TEXT NOT NULL,
      round BIGINT NOT NULL DEFAULT 0, attempt BIGINT NOT NULL DEFAULT 0,
      failures BIGINT NOT NULL DEFAULT 0, shards TEXT, dataset_id TEXT,
      weights_key TEXT, weights_size BIGINT, weights_sha256 TEXT,
      reason TEXT, final_model TEXT, metrics TEXT,
      -- Whether its module evaluates (NULL: not known yet), and its last round once that aggregated (the job
      -- completes when its evaluations are in).
      evaluates BIGINT, last_round BIGINT,
      -- A built-in job whose final adapter a worker merges into the base model (merge_adapter): the round whose
      -- adapter it is, from when the merge is queued (the job completes once the merged model is stored).
      merging BIGINT,
      created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL);
    CREATE TABLE IF NOT EXISTS worker_presence (
      worker_id TEXT PRIMARY KEY, online BIGINT NOT NULL, last_seen DOUBLE PRECISION NOT NULL,
      -- The kind the worker declared (own or platform, NULL: none): a mixed job's listed workers must have theirs.
      kind TEXT);
    CREATE TABLE IF NOT EXISTS rounds (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL, status TEXT NOT NULL,
      shards TEXT NOT NULL, started_at DOUBLE PRECISION NOT NULL, deadline DOUBLE PRECISION NOT NULL,
      ended_at DOUBLE PRECISION, reason TEXT, weights_key TEXT, metrics TEXT,
      -- The round span's ids, chosen when the round starts and recorded when it ends.
      trace_id TEXT NOT NULL, span_id TEXT NOT NULL,
      PRIMARY KEY (job_id, round, attempt));
    -- Cancels that arrived before their job's request (the two travel separately): the request, when it
    -- comes, ends the job at once instead of starting it.
    CREATE TABLE IF NOT EXISTS early_cancels (
      job_id TEXT PRIMARY KEY, reason TEXT NOT NULL, received_at DOUBLE PRECISION NOT NULL);
    -- Each evaluated round's evaluation (on a worker).
    CREATE TABLE IF NOT EXISTS evaluations (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, status TEXT NOT NULL, weights_key TEXT,
      metrics TEXT, error TEXT, worker_id TEXT, queued_at DOUBLE PRECISION NOT NULL, ended_at DOUBLE PRECISION,
      PRIMARY KEY (job_id, round));
    """ + outbox_migration("scheduler_outbox"),
]

OUTBOX = "scheduler_outbox"


@dataclass(frozen=True)
class Job:
    """One row of `jobs`: where the job stands, with its JSON columns read when asked for."""

    job_id: str
    status: JobStatus
    round: int  # the round it runs (or waits to run) now; 0 before the first
    attempt: int
    failures: int  # rounds failed in a row
    row: dict[str, Any]

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Job:
        """The job a row of `jobs` describes."""
        return cls(row["job_id"], JobStatus(row["status"]), row["round"], row["attempt"], row["failures"], row)

    @property
    def spec(self) -> JobSpec:
        """The validated job request."""
        return JobSpec.model_validate_json(self.row["spec"])

    @property
    def shards(self) -> list[ShardInfo]:
        """Its shards ([] until they are made)."""
        return [ShardInfo.model_validate(s) for s in from_json(self.row["shards"], [])]

    @property
    def evaluates(self) -> bool | None:
        """Whether its module has fl_evaluate_model (None: no evaluation has said yet)."""
        value = self.row.get("evaluates")
        return None if value is None else bool(value)

    @property
    def last_round(self) -> int | None:
        """Its last round, once that aggregated (it completes when its evaluations are in)."""
        value = self.row.get("last_round")
        return None if value is None else int(value)

    @property
    def merging(self) -> int | None:
        """The round whose adapter a worker is merging into the base model, once that is queued."""
        value = self.row.get("merging")
        return None if value is None else int(value)

    @property
    def weights(self) -> ObjectRef:
        """Its current global weights."""
        return ObjectRef(key=self.row["weights_key"], size=self.row["weights_size"],
                         sha256=self.row["weights_sha256"])


async def job(db: Executor, job_id: str) -> Job | None:
    """A job, or None if its request has not been recorded."""
    row = await db.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)
    return Job.from_row(row) if row is not None else None


async def job_exists(db: Executor, job_id: str) -> bool:
    """Whether the job's request was recorded."""
    return bool(await db.fetchval("SELECT job_id FROM jobs WHERE job_id = $1", job_id))


async def job_ids(db: Executor, *, status: JobStatus | None = None, unfinished: bool = False) -> list[str]:
    """Ids of the jobs in `status`, or of every job that has not ended, oldest first when unfinished."""
    if unfinished:
        rows = await db.fetch("SELECT job_id FROM jobs WHERE status NOT IN ($1, $2, $3) ORDER BY created_at",
                              JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)
    else:
        rows = await db.fetch("SELECT job_id FROM jobs WHERE status = $1", status)
    return [r["job_id"] for r in rows]


async def insert_job(tx: Executor, job_id: str, spec: JobSpec, status: JobStatus, now: float,
                     reason: str | None = None) -> None:
    """Record an accepted job (or one cancelled before it started, with the cancel's reason)."""
    await tx.execute(
        "INSERT INTO jobs (job_id, name, spec, status, reason, created_at, updated_at)"
        " VALUES ($1, $2, $3, $4, $5, $6, $6)",
        job_id, spec.name, spec.model_dump_json(), status, reason, now,
    )


async def set_sharded(tx: Executor, job_id: str, shards: list[ShardInfo], dataset_id: str | None,
                      weights: ObjectRef, now: float) -> None:
    """The job has its shards and initial weights: it runs."""
    await tx.execute(
        "UPDATE jobs SET status = $2, shards = $3, dataset_id = $4, weights_key = $5,"
        " weights_size = $6, weights_sha256 = $7, updated_at = $8 WHERE job_id = $1",
        job_id, JobStatus.RUNNING, to_json([s.model_dump() for s in shards]),
        dataset_id, weights.key, weights.size, weights.sha256, now,
    )


async def set_waiting(tx: Executor, job_id: str, round_index: int, attempt: int, reason: str, now: float) -> None:
    """The job's next round waits for workers, for `reason`."""
    await tx.execute(
        "UPDATE jobs SET status = $2, round = $3, attempt = $4, reason = $5, updated_at = $6 WHERE job_id = $1",
        job_id, JobStatus.WAITING, round_index, attempt, reason, now,
    )


async def end_waiting(tx: Executor, job_id: str) -> None:
    """A job that waited for workers runs again."""
    await tx.execute(
        "UPDATE jobs SET status = $2, reason = NULL WHERE job_id = $1 AND status = $3",
        job_id, JobStatus.RUNNING, JobStatus.WAITING,
    )


async def set_global_weights(tx: Executor, job_id: str, weights: ObjectRef, metrics: dict[str, float]) -> None:
    """A round aggregated: its average is the job's weights now, and the failure count restarts."""
    await tx.execute(
        "UPDATE jobs SET weights_key = $2, weights_size = $3, weights_sha256 = $4, failures = 0,"
        " metrics = $5 WHERE job_id = $1",
        job_id, weights.key, weights.size, weights.sha256, to_json(metrics),
    )


async def set_failures(tx: Executor, job_id: str, failures: int) -> None:
    """Rounds failed in a row."""
    await tx.execute("UPDATE jobs SET failures = $2 WHERE job_id = $1", job_id, failures)


async def end_job(tx: Executor, job_id: str, status: JobStatus, reason: str, now: float) -> None:
    """The job failed or was cancelled, for `reason`."""
    await tx.execute(
        "UPDATE jobs SET status = $2, reason = $3, updated_at = $4 WHERE job_id = $1",
        job_id, status, reason, now,
    )


async def complete_job(tx: Executor, job_id: str, final_uri: str, metrics: dict[str, Any], weights: ObjectRef,
                       evaluation_error: str | None, now: float) -> None:
    """The job's last round aggregated: its final model, metrics and any evaluation error."""
    await tx.execute(
        "UPDATE jobs SET status = $2, final_model = $3, metrics = $4, weights_key = $5,"
        " weights_size = $6, weights_sha256 = $7, reason = $8, updated_at = $9 WHERE job_id = $1",
        job_id, JobStatus.COMPLETED, final_uri, to_json(metrics), weights.key,
        weights.size, weights.sha256, evaluation_error, now,
    )


async def early_cancel(db: Executor, job_id: str) -> str | None:
    """The reason of a cancel that came before the job's request, if one did."""
    reason = await db.fetchval("SELECT reason FROM early_cancels WHERE job_id = $1", job_id)
    return None if reason is None else str(reason)


async def remember_cancel(db: Executor, job_id: str, reason: str, now: float) -> None:
    """Keep a cancel whose job's request has not arrived yet."""
    await db.execute(
        "INSERT INTO early_cancels (job_id, reason, received_at) VALUES ($1, $2, $3)"
        " ON CONFLICT (job_id) DO NOTHING", job_id, reason, now)


async def forget_cancel(tx: Executor, job_id: str) -> None:
    """The early cancel has been applied."""
    await tx.execute("DELETE FROM early_cancels WHERE job_id = $1", job_id)


async def record_presence(db: Executor, worker_id: str, online: bool, now: float, kind: str | None = None) -> None:
    """A worker was seen online (or said it goes offline), of the kind it declared (kept when not given)."""
    await db.execute(
        "INSERT INTO worker_presence (worker_id, online, last_seen, kind) VALUES ($1, $2, $3, $4)"
        " ON CONFLICT (worker_id) DO UPDATE SET online = $2, last_seen = $3, kind = COALESCE($4, worker_presence.kind)",
        worker_id, int(online), now, kind,
    )


async def online_workers(tx: Executor, seen_since: float) -> dict[str, str | None]:
    """Workers online and seen since then, with the kind each declared (None: none)."""
    rows = await tx.fetch("SELECT worker_id, kind FROM worker_presence WHERE online = 1 AND last_seen >= $1",
                          seen_since)
    return {r["worker_id"]: r["kind"] for r in rows}


async def insert_round(tx: Executor, job_id: str, round_index: int, attempt: int, shards: list[int],
                       started_at: float, deadline: float, trace_ids: tuple[int, int]) -> None:
    """Record a round that starts now (once), and make it the job's current one."""
    trace_id, span_id = trace_ids
    await tx.execute(
        "INSERT INTO rounds (job_id, round, attempt, status, shards, started_at, deadline, trace_id, span_id)"
        " VALUES ($1, $2, $3, 'running', $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
        job_id, round_index, attempt, to_json(shards), started_at, deadline, f"{trace_id:032x}", f"{span_id:016x}",
    )
    await tx.execute(
        "UPDATE jobs SET round = $2, attempt = $3, updated_at = $4 WHERE job_id = $1",
        job_id, round_index, attempt, started_at,
    )


async def running_round(tx: Executor, job_id: str, round_index: int, attempt: int) -> dict[str, Any] | None:
    """A round still running: when it started, its span's ids and its shards."""
    return await tx.fetchrow(
        "SELECT started_at, trace_id, span_id, shards FROM rounds WHERE job_id = $1 AND round = $2"
        " AND attempt = $3 AND status = 'running'",
        job_id, round_index, attempt,
    )


async def running_rounds(tx: Executor, job_id: str) -> list[tuple[int, int]]:
    """(round, attempt) of the job's rounds still running."""
    rows = await tx.fetch("SELECT round, attempt FROM rounds WHERE job_id = $1 AND status = 'running'", job_id)
    return [(r["round"], r["attempt"]) for r in rows]


async def close_round(tx: Executor, job_id: str, round_index: int, attempt: int, status: str, now: float, *,
                      reason: str | None = None, weights_key: str | None = None,
                      metrics: dict[str, float] | None = None) -> None:
    """A round ended with `status`."""
    await tx.execute(
        "UPDATE rounds SET status = $4, ended_at = $5, reason = $6, weights_key = $7, metrics = $8"
        " WHERE job_id = $1 AND round = $2 AND attempt = $3",
        job_id, round_index, attempt, status, now, reason, weights_key,
        to_json(metrics) if metrics is not None else None,
    )


async def round_history(db: Executor, job_id: str) -> list[dict[str, Any]]:
    """Every round of the job: round, attempt, status, reason and metrics, in order."""
    rows = await db.fetch(
        "SELECT round, attempt, status, reason, metrics FROM rounds WHERE job_id = $1 ORDER BY round, attempt",
        job_id,
    )
    return [{**r, "metrics": from_json(r["metrics"], {})} for r in rows]


async def set_current(tx: Executor, job_id: str, round_index: int, attempt: int, now: float) -> None:
    """The job runs this round and attempt now (round 0: its init task)."""
    await tx.execute("UPDATE jobs SET round = $2, attempt = $3, updated_at = $4 WHERE job_id = $1",
                     job_id, round_index, attempt, now)


async def set_weights(tx: Executor, job_id: str, weights: ObjectRef) -> None:
    """The job's current global weights (its initial ones, from its init task)."""
    await tx.execute("UPDATE jobs SET weights_key = $2, weights_size = $3, weights_sha256 = $4 WHERE job_id = $1",
                     job_id, weights.key, weights.size, weights.sha256)


async def set_last_round(tx: Executor, job_id: str, round_index: int) -> None:
    """The job's last round aggregated: it completes once its evaluations are in."""
    await tx.execute("UPDATE jobs SET last_round = $2 WHERE job_id = $1", job_id, round_index)


async def set_merging(tx: Executor, job_id: str, round_index: int) -> None:
    """A worker is asked to merge round `round_index`'s adapter into the base model."""
    await tx.execute("UPDATE jobs SET merging = $2 WHERE job_id = $1", job_id, round_index)


async def set_evaluates(tx: Executor, job_id: str, evaluates: bool) -> None:
    """Whether the job's module has fl_evaluate_model, as its first evaluation found."""
    await tx.execute("UPDATE jobs SET evaluates = $2 WHERE job_id = $1", job_id, int(evaluates))


async def insert_evaluation(tx: Executor, job_id: str, round_index: int, weights_key: str, now: float) -> None:
    """A round's evaluation is queued (once)."""
    await tx.execute(
        "INSERT INTO evaluations (job_id, round, status, weights_key, queued_at) VALUES ($1, $2, 'pending', $3, $4)"
        " ON CONFLICT DO NOTHING", job_id, round_index, weights_key, now)


async def evaluation_status(db: Executor, job_id: str, round_index: int) -> str | None:
    """A round's evaluation status, or None if none was queued."""
    value = await db.fetchval("SELECT status FROM evaluations WHERE job_id = $1 AND round = $2", job_id, round_index)
    return None if value is None else str(value)


async def settle_evaluation(tx: Executor, job_id: str, round_index: int, status: str, now: float, *,
                            metrics: dict[str, float] | None = None, error: str | None = None,
                            worker_id: str | None = None) -> None:
    """A pending evaluation ended: done (with its metrics), failed (why), or none (no function to run)."""
    await tx.execute(
        "UPDATE evaluations SET status = $3, metrics = $4, error = $5, worker_id = $6, ended_at = $7"
        " WHERE job_id = $1 AND round = $2 AND status = 'pending'",
        job_id, round_index, status, to_json(metrics or {}), error, worker_id, now)


async def evaluations(db: Executor, job_id: str) -> list[dict[str, Any]]:
    """The job's evaluations in round order: round, status, metrics and error."""
    rows = await db.fetch("SELECT round, status, metrics, error FROM evaluations WHERE job_id = $1 ORDER BY round",
                          job_id)
    return [{**r, "metrics": from_json(r["metrics"], {})} for r in rows]


async def attempts(db: Executor, job_id: str, rounds: range) -> dict[int, int]:
    """How many attempts each of `rounds` of the job has had (a round that never started is left out)."""
    rows = await db.fetch("SELECT round, MAX(attempt) AS attempts FROM rounds WHERE job_id = $1 AND round >= $2"
                          " AND round < $3 GROUP BY round", job_id, rounds.start, rounds.stop)
    return {int(r["round"]): int(r["attempts"]) for r in rows}


async def aggregated_rounds(db: Executor, job_id: str) -> dict[int, dict[str, Any]]:
    """Each aggregated round's global weights' key and its metrics, by round."""
    rows = await db.fetch("SELECT round, weights_key, metrics FROM rounds WHERE job_id = $1 AND status = 'aggregated'",
                          job_id)
    return {int(r["round"]): {"weights_key": r["weights_key"], "metrics": from_json(r["metrics"], {})} for r in rows}
