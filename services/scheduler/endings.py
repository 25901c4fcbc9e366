"""How a round or a job ends, in the caller's transaction: a round closed with its span recorded (the root of the
round's trace), the rounds a job still runs when it ends, and a failed job with its `job.failed` event. Round
outcomes, a job's commands and its finishing all end things the same way, through these."""

from __future__ import annotations

import logging
import time

from apiary import metrics as operational_metrics
from apiary import telemetry
from apiary.component import from_json
from apiary.contracts import JobFailed
from apiary.db import Executor
from apiary.outbox import Outbox
from apiary.status import JobStatus, RoundStatus
from services.scheduler import store

log = logging.getLogger("apiary.scheduler")


async def close_round(tx: Executor, job_id: str, round_index: int, attempt: int, status: RoundStatus, *,
                      reason: str | None = None, weights_key: str | None = None,
                      metrics: dict[str, float] | None = None) -> None:
    """End a round with `status`, recording its span (the root of the round's trace)."""
    row = await store.running_round(tx, job_id, round_index, attempt)
    if row is not None:
        attributes = {"apiary.job_id": job_id, "apiary.round": round_index, "apiary.attempt": attempt,
                      "apiary.shards": len(from_json(row["shards"], [])), "apiary.round.status": str(status)}
        telemetry.recorded_span(f"round {round_index}", int(row["trace_id"], 16), int(row["span_id"], 16),
                                int(row["started_at"] * 1e9), attributes, error=reason)
        operational_metrics.round_ended(str(status), time.time() - float(row["started_at"]))
    await store.close_round(tx, job_id, round_index, attempt, status, time.time(), reason=reason,
                            weights_key=weights_key, metrics=metrics)


async def close_running_rounds(tx: Executor, job_id: str, status: RoundStatus, reason: str) -> None:
    """End the job's running round, if any, with `status`: the job ended before the round did."""
    for round_index, attempt in await store.running_rounds(tx, job_id):
        await close_round(tx, job_id, round_index, attempt, status, reason=reason)


async def fail_job(tx: Executor, outbox: Outbox, job_id: str, reason: str, round_index: int | None) -> None:
    """Fail the job for `reason`; its `job.failed` goes out with the caller's transaction."""
    log.error("job %s failed: %s", job_id, reason)
    await store.end_job(tx, job_id, JobStatus.FAILED, reason, time.time())
    await outbox.add(tx, JobFailed(job_id=job_id, reason=reason, round=round_index))


__all__ = ["close_round", "close_running_rounds", "fail_job"]
