"""Which task reports the scheduler believes: an init or evaluate assignment carries a one-time secret (its
sha256 is kept here, the secret only in the assignment), and the worker's report (`worker.initialized`,
`worker.evaluated`) must present it and, where the broker vouches for a worker's user, come from the worker it
names. Anything else is forged: announced as `report.forged` (the tracker records it), never applied, so a
forged report neither sets a job's initial weights nor a round's evaluation. Tasks queued before secrets
existed (no row here) are judged on the broker user alone."""

from __future__ import annotations

from collections.abc import Sequence

from apiary import proof
from apiary.contracts import AdapterMerged, Assignment, ReportForged, TaskKind, WeightsInitialized, WorkerEvaluated
from apiary.db import Executor
from apiary.outbox import Pending

COMPONENT = "scheduler_task_proofs"
# Append only, as every component's migrations.
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS task_proofs (
      job_id TEXT NOT NULL, task TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL,
      secret_digest TEXT NOT NULL, PRIMARY KEY (job_id, task, round, attempt));
    """,
]

TaskReport = WeightsInitialized | WorkerEvaluated | AdapterMerged


async def remember(tx: Executor, queued: Sequence[Pending]) -> None:
    """Keep the digest of each task assignment's secret among `queued` (the secret itself leaves only in it)."""
    for pending in queued:
        a = pending.event
        if isinstance(a, Assignment) and a.secret:
            await tx.execute(
                "INSERT INTO task_proofs (job_id, task, round, attempt, secret_digest) VALUES ($1, $2, $3, $4, $5)"
                " ON CONFLICT (job_id, task, round, attempt) DO UPDATE SET secret_digest = $5",
                a.job_id, proof_task(a.task, a.shard if a.scores_shard else None), a.round, a.attempt,
                proof.digest(a.secret))


def proof_task(task: TaskKind, shard: int | None) -> str:
    """The task a proof is kept under: one shard's evaluation (a personal-layers job) has its own."""
    return task if shard is None else f"{task}.shard-{shard}"


async def forged(tx: Executor, task: TaskKind, report: TaskReport, user_id: str | None) -> ReportForged | None:
    """The `report.forged` event for a task report not from its assignment's worker, or None if it is."""
    round_index = 0 if isinstance(report, WeightsInitialized) else report.round
    digest = await tx.fetchval(
        "SELECT secret_digest FROM task_proofs WHERE job_id = $1 AND task = $2 AND round = $3 AND attempt = $4",
        report.job_id, proof_task(task, report.shard if isinstance(report, WorkerEvaluated) else None),
        round_index, report.attempt)
    reason = proof.judge(report.worker_id, user_id, report.secret, digest, about="the task")
    if reason is None:
        return None
    return ReportForged(job_id=report.job_id, round=round_index, attempt=report.attempt, worker_id=report.worker_id,
                        report=report.routing_key, reason=reason)


__all__ = ["COMPONENT", "MIGRATIONS", "TaskReport", "forged", "proof_task", "remember"]
