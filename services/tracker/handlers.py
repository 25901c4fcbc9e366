"""What the tracker records for each event: one function per routing key, from the event's contract model
(`decoded`: a message it does not fit is dead-lettered)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from apiary.bus import Poison
from apiary.component import to_json
from apiary.contracts import (
    DecodeError,
    JobAccepted,
    JobCompleted,
    JobFailed,
    JobRejected,
    JobRequested,
    JobSharded,
    JobTrainingEnded,
    JobWaiting,
    PresencePace,
    ReportForged,
    RoundAggregated,
    RoundAssigned,
    RoundEvaluated,
    RoundFailed,
    RoundStart,
    SecAggSummary,
    WorkerDone,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
    WorkerProgress,
    validate,
)
from apiary.db import Executor
from apiary.strategies import DEFAULT_STRATEGY
from services.tracker import async_views, store
from services.tracker.beats import heartbeat_of
from services.tracker.store import WorkerSeen

# A view takes its routing key's contract model (a job request: its body, see `decoded`).
View = Callable[[Executor, Any, float], Awaitable[None]]


def summary(key: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the event log keeps of a message."""
    # Assignments carry presigned URLs and a one-time secret, reports the secret or a token derived from it:
    # credentials do not belong in an event log.
    return {k: v for k, v in body.items() if not k.endswith("_url") and k not in ("secret", "token")}


async def _job_requested(tx: Executor, b: dict[str, Any], ts: float) -> None:
    if isinstance(b.get("job_id"), str):
        await store.job_requested(tx, b["job_id"], str(b.get("name", "")),
                                  (b.get("distributed") or {}).get("num_rounds"), ts)
        distributed = b.get("distributed") or {}
        strategy, params = distributed.get("strategy", DEFAULT_STRATEGY), distributed.get("strategy_params", {})
        if isinstance(strategy, str) and isinstance(params, dict):
            # Shown before the first round starts (a request the scheduler rejects keeps what it asked for).
            await store.job_strategy(tx, b["job_id"], strategy, params)
        split = b.get("split")
        await store.job_split(tx, b["job_id"], split if isinstance(split, dict) else {"strategy": "random"})
        code = b.get("code")
        if isinstance(code, dict):
            await store.job_code(tx, b["job_id"], {"key": code.get("key"), "sha256": code.get("sha256"),
                                                   "size": code.get("size"), "entrypoint": b.get("entrypoint")})


async def _job_sharded(tx: Executor, e: JobSharded, ts: float) -> None:
    await store.ensure_job(tx, e.job_id, ts)
    shards = [{"shard": s.index, "num_samples": s.num_samples, "labels": s.labels} for s in e.shards]
    if shards:
        await store.job_sharded(tx, e.job_id, shards)


async def _job_accepted(tx: Executor, e: JobAccepted, ts: float) -> None:
    await store.ensure_job(tx, e.job_id, ts)
    await store.job_accepted(tx, e.job_id, e.name, e.num_rounds, e.num_shards, ts)


async def _job_rejected(tx: Executor, e: JobRejected, ts: float) -> None:
    await store.ensure_job(tx, e.job_id, ts)
    await store.update_job(tx, e.job_id, ts, status="rejected", reason=e.reason,
                           errors=to_json([error.model_dump() for error in e.errors]))


async def _round_start(tx: Executor, e: RoundStart, ts: float) -> None:
    await store.ensure_job(tx, e.job_id, ts)
    await store.job_running(tx, e.job_id, e.round, e.attempt, e.num_rounds, ts)
    # An async version's shards are its tasks', announced one by one (round.assigned), with their own digests.
    shards = store.announced_digests(e) if e.asynchronous is None else {}
    await store.round_started(tx, e.job_id, e.round, e.attempt, shards, ts)
    await store.job_strategy(tx, e.job_id, e.strategy, e.strategy_params)
    await async_views.started(tx, e, ts)


async def _worker_progress(tx: Executor, e: WorkerProgress, ts: float) -> None:
    await store.shard_state(tx, e, ts, "training")
    await store.record_metrics(tx, e)
    await store.touch_worker(tx, WorkerSeen(e.worker_id, ts, state="training", job_id=e.job_id, round=e.round,
                                            shard=e.shard, samples_per_s=e.samples_per_s))


async def _worker_done(tx: Executor, e: WorkerDone, ts: float) -> None:
    await store.shard_state(tx, e, ts, "reported")
    await store.touch_worker(tx, WorkerSeen(e.worker_id, ts, state="idle"))


async def _worker_failed(tx: Executor, e: WorkerFailed, ts: float) -> None:
    await store.shard_state(tx, e, ts, "failed")
    await store.touch_worker(tx, WorkerSeen(e.worker_id, ts, state="idle"))


def _secure(summary: SecAggSummary | None) -> str | None:
    return None if summary is None else summary.model_dump_json()


async def _round_aggregated(tx: Executor, e: RoundAggregated, ts: float) -> None:
    await store.round_ended(tx, e.job_id, e.round, e.attempt, "aggregated", ts, metrics=to_json(e.metrics),
                            secure=_secure(e.secure_aggregation))
    rejected = {int(shard): reason for shard, reason in e.rejected.items()}
    await store.shards_rejected(tx, e.job_id, e.round, e.attempt, rejected)
    await async_views.aggregated(tx, e, ts)


async def _round_failed(tx: Executor, e: RoundFailed, ts: float) -> None:
    await store.round_ended(tx, e.job_id, e.round, e.attempt, "failed", ts, reason=e.reason,
                            secure=_secure(e.secure_aggregation))


async def _round_evaluated(tx: Executor, e: RoundEvaluated, ts: float) -> None:
    if e.found:
        await store.round_evaluated(tx, e.job_id, e.round, e.attempt, e.metrics, e.error, e.shards)


async def _report_forged(tx: Executor, e: ReportForged, ts: float) -> None:
    # A task report the scheduler refused (not from its assignment's worker): kept as the forged reports judged
    # here are.
    await store.record_forged(tx, e, e.reason, ts)


async def _job_completed(tx: Executor, e: JobCompleted, ts: float) -> None:
    await store.ensure_job(tx, e.job_id, ts)
    await store.update_job(tx, e.job_id, ts, status="completed", round=e.rounds_completed,
                           final_model=e.final_model, metrics=to_json(e.metrics), reason=e.reason)
    # Early stopping ends a job while its next round runs: that round is cancelled (the scheduler's record).
    await store.running_round_ended(tx, e.job_id, "cancelled", f"job completed: {e.reason or 'completed'}", ts)


async def _job_training_ended(tx: Executor, e: JobTrainingEnded, ts: float) -> None:
    # Mode async: the workers stop the tasks still out; they will report nothing.
    await store.tasks_stopped(tx, e.job_id, f"stopped: version {e.version}, the job's last, is stored", ts)


async def _job_waiting(tx: Executor, e: JobWaiting, ts: float) -> None:
    await store.ensure_job(tx, e.job_id, ts)
    await store.update_job(tx, e.job_id, ts, status="waiting", reason=e.reason)


async def _job_failed(tx: Executor, e: JobFailed, ts: float) -> None:
    await store.ensure_job(tx, e.job_id, ts)
    # The round it was in ends with it (a result that still comes in is recorded as it arrives).
    await store.job_ended(tx, e.job_id, "cancelled" if e.cancelled else "failed", e.reason, ts)


async def _worker_online(tx: Executor, e: WorkerOnline, ts: float) -> None:
    await store.touch_worker(tx, WorkerSeen(e.worker_id, ts, state="idle", hostname=e.hostname,
                                            gpu=to_json(e.gpu) if e.gpu else None, kind=e.kind))


async def _worker_heartbeat(tx: Executor, e: WorkerHeartbeat, ts: float) -> None:
    # The worker's own row is written with the next batch of heartbeats (services.tracker.beats).
    if e.state == "training" and e.job_id is not None and e.shard is not None:
        # The worker took the shard but has not reported progress yet: it is training, not waiting.
        await store.shard_taken(tx, e.job_id, e.round, e.shard, e.worker_id, ts)


async def _worker_offline(tx: Executor, e: WorkerOffline, ts: float) -> None:
    await store.touch_worker(tx, WorkerSeen(e.worker_id, ts, state="stopped"))
    await store.worker_offline(tx, e.worker_id)


VIEWS: dict[str, View] = {
    JobRequested.routing_key: _job_requested,
    JobAccepted.routing_key: _job_accepted,
    JobRejected.routing_key: _job_rejected,
    JobSharded.routing_key: _job_sharded,
    RoundStart.routing_key: _round_start,
    WorkerProgress.routing_key: _worker_progress,
    WorkerDone.routing_key: _worker_done,
    WorkerFailed.routing_key: _worker_failed,
    WorkerDone.async_routing_key: _worker_done,
    WorkerFailed.async_routing_key: _worker_failed,
    RoundAggregated.routing_key: _round_aggregated,
    RoundFailed.routing_key: _round_failed,
    RoundEvaluated.routing_key: _round_evaluated,
    ReportForged.routing_key: _report_forged,
    JobCompleted.routing_key: _job_completed,
    JobFailed.routing_key: _job_failed,
    JobTrainingEnded.routing_key: _job_training_ended,
    JobWaiting.routing_key: _job_waiting,
    WorkerOnline.routing_key: _worker_online,
    WorkerHeartbeat.routing_key: _worker_heartbeat,
    WorkerOffline.routing_key: _worker_offline,
    RoundAssigned.routing_key: async_views.assigned,
}


def decoded(key: str, body: dict[str, Any]) -> Any:
    """What the tracker takes of a message: its contract model (None: it has no view and is not a pace, the event
    log alone keeps it); Poison, saying what is wrong, if a message with a view does not fit its model."""
    if key == PresencePace.routing_key or key.startswith(f"{PresencePace.routing_key}."):
        # No view, but the tracker hears the pace (services.tracker.service); one it cannot read says nothing.
        with contextlib.suppress(DecodeError):
            return validate(key, body)
        return None
    if key not in VIEWS:
        return None
    if key == JobRequested.routing_key:
        # A request the scheduler will reject, which its model refuses, is shown too (under its name, with why).
        return body
    if key == WorkerHeartbeat.routing_key:
        return heartbeat_of(body)
    try:
        return validate(key, body)
    except DecodeError as e:
        raise Poison(str(e)) from e
