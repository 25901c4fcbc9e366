"""What the tracker records for each event: one function per routing key, from the message body alone
(a missing field raises KeyError or TypeError, which the tracker dead-letters)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from apiary.component import to_json
from apiary.db import Executor
from apiary.strategies import DEFAULT_STRATEGY
from services.tracker import store

View = Callable[[Executor, dict[str, Any], float], Awaitable[None]]


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


async def _job_sharded(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.ensure_job(tx, b["job_id"], ts)
    shards = [{"shard": int(s["index"]), "num_samples": int(s["num_samples"]), "labels": s.get("labels")}
              for s in b.get("shards") or []]
    if shards:
        await store.job_sharded(tx, b["job_id"], shards)


async def _job_accepted(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.ensure_job(tx, b["job_id"], ts)
    await store.job_accepted(tx, b["job_id"], b["name"], b["num_rounds"], b["num_shards"], ts)


async def _job_rejected(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.ensure_job(tx, b["job_id"], ts)
    await store.update_job(tx, b["job_id"], ts, status="rejected", reason=b["reason"],
                           errors=to_json(b.get("errors", [])))


async def _round_start(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.ensure_job(tx, b["job_id"], ts)
    await store.job_running(tx, b["job_id"], b["round"], b["attempt"], b["num_rounds"], ts)
    secrets, progress = b.get("secret_digests") or {}, b.get("progress_digests") or {}
    digests = {int(s): (secrets.get(str(s), ""), progress.get(str(s), "")) for s in b["shards"]}
    await store.round_started(tx, b["job_id"], b["round"], b["attempt"], digests, ts)
    await store.job_strategy(tx, b["job_id"], b.get("strategy", DEFAULT_STRATEGY), b.get("strategy_params", {}))


async def _worker_progress(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.shard_state(tx, b, ts, "training")
    await store.record_metrics(tx, b, ts)
    await store.touch_worker(tx, b["worker_id"], ts, state="training", job_id=b["job_id"], round_index=b["round"],
                             shard=b["shard"], samples_per_s=b.get("samples_per_s"))


async def _worker_done(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.shard_state(tx, b, ts, "reported")
    await store.touch_worker(tx, b["worker_id"], ts, state="idle")


async def _worker_failed(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.shard_state(tx, b, ts, "failed", error=b.get("error"))
    await store.touch_worker(tx, b["worker_id"], ts, state="idle")


async def _round_aggregated(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.round_ended(tx, b["job_id"], b["round"], b["attempt"], "aggregated", ts,
                            metrics=to_json(b.get("metrics", {})))
    rejected = {int(shard): reason for shard, reason in (b.get("rejected") or {}).items()}
    await store.shards_rejected(tx, b["job_id"], b["round"], b["attempt"], rejected)


async def _round_failed(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.round_ended(tx, b["job_id"], b["round"], b["attempt"], "failed", ts, reason=b["reason"])


async def _round_evaluated(tx: Executor, b: dict[str, Any], ts: float) -> None:
    if b.get("found", True) is not False:
        await store.round_evaluated(tx, b["job_id"], b["round"], b.get("attempt", 1), b.get("metrics") or {},
                                    b.get("error"))


async def _report_forged(tx: Executor, b: dict[str, Any], ts: float) -> None:
    # A task report the scheduler refused (not from its assignment's worker): kept as the forged reports judged
    # here are.
    await store.record_forged(tx, str(b["report"]), b, str(b["reason"]), ts)


async def _job_completed(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.ensure_job(tx, b["job_id"], ts)
    await store.update_job(tx, b["job_id"], ts, status="completed", round=b["rounds_completed"],
                           final_model=b["final_model"], metrics=to_json(b.get("metrics", {})),
                           reason=b.get("reason"))
    # Early stopping ends a job while its next round runs: that round is cancelled (the scheduler's record).
    await store.running_round_ended(tx, b["job_id"], "cancelled", f"job completed: {b.get('reason') or 'completed'}",
                                    ts)


async def _job_waiting(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.ensure_job(tx, b["job_id"], ts)
    await store.update_job(tx, b["job_id"], ts, status="waiting", reason=b["reason"])


async def _job_failed(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.ensure_job(tx, b["job_id"], ts)
    # The round it was in ends with it (a result that still comes in is recorded as it arrives).
    status = "cancelled" if b.get("cancelled") is True else "failed"
    await store.job_ended(tx, b["job_id"], status, b["reason"], ts)


async def _worker_online(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.touch_worker(tx, b["worker_id"], ts, state="idle", hostname=b.get("hostname"), gpu=b.get("gpu"),
                             kind=_kind(b))


async def _worker_heartbeat(tx: Executor, b: dict[str, Any], ts: float) -> None:
    # The worker's own row is written with the next batch of heartbeats (services.tracker.beats).
    if b.get("state") == "training" and isinstance(b.get("job_id"), str) and isinstance(b.get("shard"), int):
        # The worker took the shard but has not reported progress yet: it is training, not waiting.
        await store.shard_taken(tx, b["job_id"], b.get("round"), b["shard"], b["worker_id"], ts)


def _kind(b: dict[str, Any]) -> str | None:
    kind = b.get("kind")
    return kind if isinstance(kind, str) else None


async def _worker_offline(tx: Executor, b: dict[str, Any], ts: float) -> None:
    await store.touch_worker(tx, b["worker_id"], ts, state="stopped")
    await store.worker_offline(tx, b["worker_id"])


VIEWS: dict[str, View] = {
    "job.requested": _job_requested,
    "job.accepted": _job_accepted,
    "job.rejected": _job_rejected,
    "job.sharded": _job_sharded,
    "round.start": _round_start,
    "worker.progress": _worker_progress,
    "worker.done": _worker_done,
    "worker.failed": _worker_failed,
    "round.aggregated": _round_aggregated,
    "round.failed": _round_failed,
    "round.evaluated": _round_evaluated,
    "report.forged": _report_forged,
    "job.completed": _job_completed,
    "job.failed": _job_failed,
    "job.waiting": _job_waiting,
    "worker.online": _worker_online,
    "worker.heartbeat": _worker_heartbeat,
    "worker.offline": _worker_offline,
}
