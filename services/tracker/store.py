"""The tracker's tables (event log, job/round/shard views, workers, metric series): their migrations and
every statement that writes them. The views people read are queried in `views`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from apiary.component import to_json
from apiary.contracts import ReportForged, RoundStart, WorkerDone, WorkerFailed, WorkerHeartbeat, WorkerProgress
from apiary.db import Executor

ShardReport = WorkerProgress | WorkerDone | WorkerFailed

# Version 1 is the schema as 0.1.0 ships it; append a step for each later change (a database records how many
# of these it has applied).
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS events (
      seq {autoid}, ts DOUBLE PRECISION NOT NULL, routing_key TEXT NOT NULL, job_id TEXT,
      round BIGINT, body TEXT NOT NULL);
    CREATE INDEX IF NOT EXISTS events_job ON events (job_id, seq);
    CREATE TABLE IF NOT EXISTS job_views (
      job_id TEXT PRIMARY KEY, name TEXT, status TEXT NOT NULL, round BIGINT NOT NULL DEFAULT 0,
      attempt BIGINT NOT NULL DEFAULT 0, num_rounds BIGINT, num_shards BIGINT, reason TEXT,
      errors TEXT, final_model TEXT, metrics TEXT,
      -- The aggregation strategy and its parameters, from the request and then the rounds.
      strategy TEXT, strategy_params TEXT,
      -- How the dataset was split (the request's `split`) and what each shard holds (from job.sharded).
      split TEXT, data_shards TEXT,
      -- The code bundle (key, sha256, size, entrypoint), from the request.
      code TEXT,
      created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL);
    CREATE TABLE IF NOT EXISTS round_views (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL, status TEXT NOT NULL,
      metrics TEXT, reason TEXT, started_at DOUBLE PRECISION, ended_at DOUBLE PRECISION,
      -- The round's evaluation metrics (round.evaluated, on a worker) or why its evaluation failed.
      evaluation TEXT, evaluation_error TEXT,
      -- What secure aggregation did in the round (JSON of contracts.SecAggSummary; NULL: a round in the clear).
      secure_aggregation TEXT,
      -- A personal-layers job's evaluation, shard by shard (its `evaluation` is their mean).
      evaluation_shards TEXT,
      PRIMARY KEY (job_id, round, attempt));
    CREATE TABLE IF NOT EXISTS shard_views (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL, shard BIGINT NOT NULL,
      worker_id TEXT, state TEXT NOT NULL, metrics TEXT, error TEXT,
      -- The step the shard's training reached, for the per-worker progress table.
      step BIGINT,
      -- The digests of the shard's assignment secret and progress token, as round.start announced them
      -- ('' where it announced none, which nothing proves).
      secret_digest TEXT NOT NULL, progress_digest TEXT NOT NULL,
      updated_at DOUBLE PRECISION NOT NULL,
      PRIMARY KEY (job_id, round, attempt, shard));
    CREATE TABLE IF NOT EXISTS workers (
      worker_id TEXT PRIMARY KEY, hostname TEXT, status TEXT NOT NULL, state TEXT,
      job_id TEXT, round BIGINT, shard BIGINT, gpu TEXT, samples_per_s DOUBLE PRECISION,
      -- The kind the worker declared when it started (own: the user's machine, platform: ours), for mixed jobs.
      kind TEXT,
      first_seen DOUBLE PRECISION NOT NULL, last_seen DOUBLE PRECISION NOT NULL);
    CREATE TABLE IF NOT EXISTS metrics (
      seq {autoid}, job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL,
      worker_id TEXT NOT NULL, shard BIGINT NOT NULL, step BIGINT, name TEXT NOT NULL,
      value DOUBLE PRECISION NOT NULL, ts DOUBLE PRECISION NOT NULL);
    CREATE INDEX IF NOT EXISTS metrics_job ON metrics (job_id, seq);
    -- The worker reports that presented neither the assignment's secret nor its progress token (or came from
    -- another worker's broker user): recorded as forged, never applied to the views.
    CREATE TABLE IF NOT EXISTS forged_reports (
      seq {autoid}, job_id TEXT NOT NULL, round BIGINT, attempt BIGINT, shard BIGINT, worker_id TEXT,
      routing_key TEXT NOT NULL, reason TEXT NOT NULL, ts DOUBLE PRECISION NOT NULL);
    CREATE INDEX IF NOT EXISTS forged_reports_job ON forged_reports (job_id, seq)
    """,
]

SHARD_ROWS_PER_INSERT = 300  # three parameters a row: under SQLite's (999 before 3.32) and PostgreSQL's limits



async def record_event(tx: Executor, ts: float, key: str, job_id: str | None, round_index: int | None,
                       body: dict[str, Any]) -> None:
    """Append an event to the log."""
    await tx.execute("INSERT INTO events (ts, routing_key, job_id, round, body) VALUES ($1, $2, $3, $4, $5)",
                     ts, key, job_id, round_index, to_json(body))


async def job_requested(tx: Executor, job_id: str, name: str, num_rounds: int | None, ts: float) -> None:
    """A job's request was seen (once)."""
    await tx.execute(
        "INSERT INTO job_views (job_id, name, status, num_rounds, created_at, updated_at)"
        " VALUES ($1, $2, 'requested', $3, $4, $4) ON CONFLICT DO NOTHING",
        job_id, name, num_rounds, ts,
    )


async def job_strategy(tx: Executor, job_id: str, strategy: str, params: dict[str, Any]) -> None:
    """The job's aggregation strategy and its parameters."""
    await tx.execute("UPDATE job_views SET strategy = $2, strategy_params = $3 WHERE job_id = $1",
                     job_id, strategy, to_json(params))


async def job_split(tx: Executor, job_id: str, split: dict[str, Any]) -> None:
    """How the job's request asks for its dataset to be split."""
    await tx.execute("UPDATE job_views SET split = $2 WHERE job_id = $1", job_id, to_json(split))


async def job_code(tx: Executor, job_id: str, code: dict[str, Any]) -> None:
    """The job's code bundle: key, sha256, size (where the request gave it) and entrypoint."""
    await tx.execute("UPDATE job_views SET code = $2 WHERE job_id = $1", job_id, to_json(code))


async def job_sharded(tx: Executor, job_id: str, shards: list[dict[str, Any]]) -> None:
    """What each shard of the job's dataset holds: its sample count and label histogram."""
    await tx.execute("UPDATE job_views SET data_shards = $2 WHERE job_id = $1", job_id, to_json(shards))


async def ensure_job(tx: Executor, job_id: str, ts: float) -> None:
    """A job's row, created if this is the first event seen of it."""
    await tx.execute(
        "INSERT INTO job_views (job_id, status, created_at, updated_at) VALUES ($1, 'requested', $2, $2)"
        " ON CONFLICT DO NOTHING",
        job_id, ts,
    )


async def update_job(tx: Executor, job_id: str, ts: float, **columns: Any) -> None:
    """Set some of a job's columns, and its update time. Column names come from this service's handlers,
    never from a message."""
    assignments = ", ".join(f"{name} = ${i}" for i, name in enumerate(columns, start=3))
    await tx.execute(f"UPDATE job_views SET {assignments}, updated_at = $2 WHERE job_id = $1",
                     job_id, ts, *columns.values())


async def job_running(tx: Executor, job_id: str, round_index: int, attempt: int, num_rounds: int,
                      ts: float) -> None:
    """The job runs this round and attempt, unless it already ended."""
    await tx.execute(
        "UPDATE job_views SET status = 'running', reason = NULL, round = $2, attempt = $3, num_rounds = $4,"
        " updated_at = $5 WHERE job_id = $1 AND status NOT IN ('completed', 'failed', 'cancelled')",
        job_id, round_index, attempt, num_rounds, ts,
    )


async def job_accepted(tx: Executor, job_id: str, name: str, num_rounds: int, num_shards: int, ts: float) -> None:
    """The scheduler accepted the job: it is being sharded, unless it already ended."""
    await tx.execute(
        "UPDATE job_views SET name = $2, num_rounds = $3, num_shards = $4, updated_at = $5,"
        # A job can end before its acceptance is seen here (cancelled before it started, say).
        " status = CASE WHEN status IN ('completed', 'failed', 'cancelled', 'rejected') THEN status"
        " ELSE 'sharding' END"
        " WHERE job_id = $1",
        job_id, name, num_rounds, num_shards, ts,
    )


async def job_ended(tx: Executor, job_id: str, status: str, reason: str, ts: float) -> None:
    """The job failed or was cancelled; the round it was in ends with it."""
    await update_job(tx, job_id, ts, status=status, reason=reason)
    await running_round_ended(tx, job_id, status, reason, ts)


async def running_round_ended(tx: Executor, job_id: str, status: str, reason: str, ts: float) -> None:
    """The job's running round, if any, ends with the job (`status`: failed or cancelled)."""
    await tx.execute(
        "UPDATE round_views SET status = $2, reason = $3, ended_at = $4 WHERE job_id = $1 AND status = 'running'",
        job_id, status, reason, ts,
    )


def announced_digests(start: RoundStart) -> dict[int, tuple[str, str]]:
    """Each shard's (secret digest, progress-token digest) as a round.start announces them; a shard it announced no
    digest for stores '': no report can prove it."""
    return {s: (start.secret_digests.get(s, ""), start.progress_digests.get(s, "")) for s in start.shards}


async def round_started(tx: Executor, job_id: str, round_index: int, attempt: int,
                        shards: dict[int, tuple[str, str]], ts: float) -> None:
    """A round started on these shards, each with its (secret digest, progress-token digest) as round.start
    announced them (recorded once)."""
    await tx.execute(
        "INSERT INTO round_views (job_id, round, attempt, status, started_at) VALUES ($1, $2, $3, 'running', $4)"
        " ON CONFLICT DO NOTHING",
        job_id, round_index, attempt, ts,
    )
    rows = list(shards.items())
    for start in range(0, len(rows), SHARD_ROWS_PER_INSERT):
        chunk = rows[start : start + SHARD_ROWS_PER_INSERT]
        values = ", ".join(f"($1, $2, $3, ${i}, ${i + 1}, ${i + 2}, 'assigned', $4)"
                           for i in range(5, 5 + 3 * len(chunk), 3))
        await tx.execute(
            "INSERT INTO shard_views (job_id, round, attempt, shard, secret_digest, progress_digest, state,"
            f" updated_at) VALUES {values} ON CONFLICT DO NOTHING",
            job_id, round_index, attempt, ts, *(value for shard, digests in chunk for value in (shard, *digests)),
        )


async def shard_digest_row(tx: Executor, job_id: str, round_index: int, attempt: int | None,
                           shard: int) -> dict[str, Any] | None:
    """A shard's digests in a round attempt (the latest attempt when `attempt` is None); None if unknown."""
    sql = "SELECT secret_digest, progress_digest FROM shard_views WHERE job_id = $1 AND round = $2 AND shard = $3"
    if attempt is None:
        return await tx.fetchrow(sql + " ORDER BY attempt DESC LIMIT 1", job_id, round_index, shard)
    return await tx.fetchrow(sql + " AND attempt = $4", job_id, round_index, shard, attempt)


async def record_forged(tx: Executor, report: ShardReport | WorkerHeartbeat | ReportForged, reason: str,
                        ts: float) -> None:
    """A report that did not come from the shard's assigned worker: kept, with why, and nothing else (a report
    naming no job is not kept: there is no job to show it with)."""
    if report.job_id is None:
        return
    # A heartbeat names no attempt, and a task report the scheduler refused (report.forged) no shard.
    attempt, shard = getattr(report, "attempt", None), getattr(report, "shard", None)
    key = report.report if isinstance(report, ReportForged) else report.routing_key
    await tx.execute(
        "INSERT INTO forged_reports (job_id, round, attempt, shard, worker_id, routing_key, reason, ts)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        report.job_id, report.round, attempt, shard, report.worker_id, key, reason, ts,
    )


async def round_ended(tx: Executor, job_id: str, round_index: int, attempt: int, status: str, ts: float, *,
                      metrics: str | None = None, reason: str | None = None, secure: str | None = None) -> None:
    """A running round aggregated (with its metrics, as JSON) or failed (with why); `secure`: what secure
    aggregation did in it (JSON)."""
    await tx.execute(
        "UPDATE round_views SET status = $4, metrics = COALESCE($5, metrics), reason = COALESCE($6, reason),"
        " ended_at = $7, secure_aggregation = COALESCE($8, secure_aggregation)"
        " WHERE job_id = $1 AND round = $2 AND attempt = $3 AND status = 'running'",
        job_id, round_index, attempt, status, metrics, reason, ts, secure,
    )


async def shards_rejected(tx: Executor, job_id: str, round_index: int, attempt: int,
                          reasons: dict[int, str]) -> None:
    """The aggregator refused these shards' contributions (shard -> why)."""
    for shard, reason in reasons.items():
        await tx.execute(
            "UPDATE shard_views SET state = 'rejected', error = $5"
            " WHERE job_id = $1 AND round = $2 AND attempt = $3 AND shard = $4",
            job_id, round_index, attempt, shard, reason,
        )


async def shard_state(tx: Executor, report: ShardReport, ts: float, state: str) -> None:
    """A worker's report on a shard (its progress, result or failure) sets the shard's state."""
    # A progress report that arrives after the shard's result must not turn it back into "training".
    settled = "AND state NOT IN ('reported', 'failed', 'rejected')" if state == "training" else ""
    metrics = None if isinstance(report, WorkerFailed) else report.metrics
    await tx.execute(
        "UPDATE shard_views SET worker_id = $5, state = $6, metrics = COALESCE($7, metrics),"
        " error = $8, step = COALESCE($9, step), updated_at = $10"
        f" WHERE job_id = $1 AND round = $2 AND attempt = $3 AND shard = $4 {settled}",
        report.job_id, report.round, report.attempt, report.shard, report.worker_id, state,
        to_json(metrics) if metrics else None, report.error if isinstance(report, WorkerFailed) else None,
        report.step if isinstance(report, WorkerProgress) else None, ts,
    )


async def tasks_stopped(tx: Executor, job_id: str, reason: str, ts: float) -> None:
    """The job's training tasks still out were stopped (mode async: its last version is stored)."""
    await tx.execute(
        "UPDATE shard_views SET state = 'stopped', error = $2, updated_at = $3"
        " WHERE job_id = $1 AND state IN ('assigned', 'training')",
        job_id, reason, ts,
    )


async def shard_taken(tx: Executor, job_id: str, round_index: int | None, shard: int, worker_id: str,
                      ts: float) -> None:
    """A worker took an assigned shard (before its first progress report)."""
    await tx.execute(
        "UPDATE shard_views SET state = 'training', worker_id = $4, updated_at = $5"
        " WHERE job_id = $1 AND round = $2 AND shard = $3 AND state = 'assigned'",
        job_id, round_index, shard, worker_id, ts,
    )


async def record_metrics(tx: Executor, progress: WorkerProgress) -> None:
    """A progress report's metrics, one point per name, at the report's time."""
    for name, value in progress.metrics.items():
        await tx.execute(
            "INSERT INTO metrics (job_id, round, attempt, worker_id, shard, step, name, value, ts)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            progress.job_id, progress.round, progress.attempt, progress.worker_id, progress.shard, progress.step,
            name, float(value), progress.ts,
        )


@dataclass(frozen=True)
class WorkerSeen:
    """A worker seen (a heartbeat, its presence or a report on a shard): what its row in workers becomes. A
    field left None keeps the row's, except the shard it is on (job_id, round, shard), which None clears."""

    worker_id: str
    ts: float  # when the tracker received it: the row's last_seen
    state: str | None = None
    job_id: str | None = None
    round: int | None = None
    shard: int | None = None
    gpu: str | None = None  # JSON
    samples_per_s: float | None = None
    kind: str | None = None
    hostname: str | None = None

    def row(self) -> tuple[Any, ...]:
        """The values of `beats`' row (BEAT_COLUMNS), in its order."""
        return (self.worker_id, self.state, self.job_id, self.round, self.shard, self.gpu, self.samples_per_s,
                self.kind, self.ts)


async def touch_worker(tx: Executor, seen: WorkerSeen) -> None:
    """A worker was seen: online, in its state, on its shard (none when not given), of its kind."""
    # One statement (a report's transaction runs several): its row made, or every field it names set.
    await tx.execute(
        "INSERT INTO workers (worker_id, state, hostname, job_id, round, shard, gpu, samples_per_s, last_seen, kind,"
        " status, first_seen) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'online', $9)"
        " ON CONFLICT (worker_id) DO UPDATE SET status = 'online', state = COALESCE(excluded.state, workers.state),"
        " hostname = COALESCE(excluded.hostname, workers.hostname), job_id = excluded.job_id,"
        " round = excluded.round, shard = excluded.shard, gpu = COALESCE(excluded.gpu, workers.gpu),"
        " samples_per_s = COALESCE(excluded.samples_per_s, workers.samples_per_s),"
        " last_seen = excluded.last_seen, kind = COALESCE(excluded.kind, workers.kind)",
        seen.worker_id, seen.state, seen.hostname, seen.job_id, seen.round, seen.shard, seen.gpu,
        seen.samples_per_s, seen.ts, seen.kind,
    )


BEAT_COLUMNS = ("worker_id", "state", "job_id", "round", "shard", "gpu", "samples_per_s", "kind", "last_seen")


async def beats(tx: Executor, rows: list[tuple[Any, ...]]) -> None:
    """Workers' heartbeats (rows of BEAT_COLUMNS), in one statement: each worker online, in its state, on its
    shard (none when not given), as of the beat; a row already newer than its beat is left as it is."""
    width = len(BEAT_COLUMNS)
    values = ", ".join(
        "(" + ", ".join(f"${i * width + j + 1}" for j in range(width)) + f", 'online', ${i * width + width})"
        for i in range(len(rows)))
    await tx.execute(
        f"INSERT INTO workers ({', '.join(BEAT_COLUMNS)}, status, first_seen) VALUES {values}"
        " ON CONFLICT (worker_id) DO UPDATE SET status = 'online', state = COALESCE(excluded.state, workers.state),"
        " job_id = excluded.job_id, round = excluded.round, shard = excluded.shard,"
        " gpu = COALESCE(excluded.gpu, workers.gpu),"
        " samples_per_s = COALESCE(excluded.samples_per_s, workers.samples_per_s),"
        " kind = COALESCE(excluded.kind, workers.kind), last_seen = excluded.last_seen"
        " WHERE workers.last_seen <= excluded.last_seen",
        *(value for row in rows for value in row),
    )


async def worker_offline(tx: Executor, worker_id: str) -> None:
    """A worker said it goes offline."""
    await tx.execute("UPDATE workers SET status = 'offline' WHERE worker_id = $1", worker_id)


async def mark_silent_offline(db: Executor, seen_before: float) -> int:
    """Workers online but not seen since then are offline; return how many changed."""
    return await db.execute(
        "UPDATE workers SET status = 'offline' WHERE status = 'online' AND last_seen < $1", seen_before
    )


async def round_evaluated(tx: Executor, job_id: str, round_index: int, attempt: int, metrics: dict[str, float],
                          error: str | None, shards: dict[int, dict[str, float]] | None = None) -> None:
    """A round's evaluation: its metrics (and a personal-layers job's, shard by shard), or why it failed; the first
    report counts (a redelivery changes nothing). Round 0's (a built-in job's starting model) gets its own row, as
    no round started it."""
    if round_index == 0:
        await tx.execute("INSERT INTO round_views (job_id, round, attempt, status) VALUES ($1, 0, $2, 'initial')"
                         " ON CONFLICT DO NOTHING", job_id, attempt)
    await tx.execute(
        "UPDATE round_views SET evaluation = $4, evaluation_error = $5, evaluation_shards = $6 WHERE job_id = $1"
        " AND round = $2 AND attempt = $3 AND evaluation IS NULL AND evaluation_error IS NULL",
        job_id, round_index, attempt, None if error else to_json(metrics), error,
        to_json({str(k): v for k, v in shards.items()}) if shards and not error else None)
