"""Which worker reports the tracker believes: a report on a shard must present the assignment's secret
(`worker.done`, `worker.failed`) or its progress token (`worker.progress`, a training heartbeat), and a
worker's broker user may speak only for that worker. A report that does not is recorded as forged and
changes no view (a forged failure does not fail the shard, a forged heartbeat does not move the worker)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from apiary import proof
from apiary.db import Executor
from services.tracker import store

# Routing key -> (the body's field that proves it, the shard_views column holding its digest, what it is).
PROOFS: dict[str, tuple[str, str, str]] = {
    "worker.done": ("secret", "secret_digest", proof.SECRET),
    "worker.failed": ("secret", "secret_digest", proof.SECRET),
    "worker.progress": ("token", "progress_digest", proof.TOKEN),
    "worker.heartbeat": ("token", "progress_digest", proof.TOKEN),
}


def judge(key: str, body: Mapping[str, Any], digests: Mapping[str, Any] | None, user_id: str | None) -> str | None:
    """Why a worker report is forged, or None: `digests` is its shard's row (None: the shard is unknown here,
    or the round predates secrets, and only the broker user is judged)."""
    field, column, what = PROOFS[key]
    presented, worker_id = body.get(field), body.get("worker_id", "")
    return proof.judge(worker_id, user_id, presented if isinstance(presented, str) else None,
                       (digests or {}).get(column), what=what, about=f"shard {body.get('shard')}")


def names_a_shard(key: str, body: Mapping[str, Any]) -> bool:
    """Whether a report speaks about one shard of one round (an idle heartbeat does not)."""
    return (isinstance(body.get("job_id"), str) and isinstance(body.get("round"), int)
            and isinstance(body.get("shard"), int) and (key != "worker.heartbeat" or body.get("state") == "training"))


async def forged(tx: Executor, key: str, body: dict[str, Any], user_id: str | None, ts: float) -> bool:
    """Judge a worker report against its shard's digests; record it as forged (True) or let it through."""
    if key not in PROOFS:
        return False
    digests = None
    if names_a_shard(key, body):
        attempt = body.get("attempt") if key != "worker.heartbeat" else None
        digests = await store.shard_digest_row(tx, body["job_id"], body["round"],
                                               attempt if isinstance(attempt, int) else None, body["shard"])
    reason = judge(key, body, digests, user_id)
    if reason is None:
        return False
    if isinstance(body.get("job_id"), str):
        await store.record_forged(tx, key, body, reason, ts)
    return True
