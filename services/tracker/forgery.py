"""Which worker reports the tracker believes: a report on a shard must present the assignment's secret
(`worker.done`, `worker.failed`) or its progress token (`worker.progress`, a training heartbeat), and a
worker's broker user may speak only for that worker (apiary.proof.judge). A report that does not is recorded
as forged and changes no view (a forged failure does not fail the shard, a forged heartbeat does not move the
worker)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from apiary import proof
from apiary.contracts import RoundStart, WorkerDone, WorkerFailed, WorkerHeartbeat, WorkerProgress
from apiary.db import Executor
from services.tracker import store

WorkerReport = WorkerDone | WorkerFailed | WorkerProgress | WorkerHeartbeat


def judge(report: WorkerReport, digests: Mapping[str, Any] | None, user_id: str | None) -> str | None:
    """Why a worker report is forged, or None: `digests` is its shard's row (None: the shard is unknown here,
    and only the broker user is judged)."""
    presented: str | None
    if isinstance(report, WorkerDone | WorkerFailed):
        presented, column, what = report.secret, "secret_digest", proof.SECRET
    else:
        presented, column, what = report.token, "progress_digest", proof.TOKEN
    return proof.judge(report.worker_id, user_id, presented, (digests or {}).get(column), what=what,
                       about=f"shard {report.shard}")


def shard_of(report: WorkerReport) -> tuple[str, int, int | None, int] | None:
    """The job, round, attempt and shard a report speaks about; None for a heartbeat while not training (a
    heartbeat names no attempt: None, the round's latest)."""
    if not isinstance(report, WorkerHeartbeat):
        return report.job_id, report.round, report.attempt, report.shard
    if report.state == "training" and report.job_id is not None and report.round is not None and (
            report.shard is not None):
        return report.job_id, report.round, None, report.shard
    return None


ShardKey = tuple[str, int, int | None, int]
DIGESTS_KEPT = 4096  # shards whose digests a tracker remembers


class KnownDigests:
    """Shards' digest rows a committed transaction stored (round.start) or read: stored once, never changed, so the
    round's reports (result, failure, progress) need not read them again. A heartbeat's (the round's latest
    attempt, which a new attempt changes) is never kept."""

    def __init__(self) -> None:
        self._rows: dict[ShardKey, Mapping[str, Any]] = {}

    def get(self, shard: ShardKey) -> Mapping[str, Any] | None:
        """The shard's row, if known."""
        return self._rows.get(shard)

    def keep(self, read: list[tuple[ShardKey, Mapping[str, Any]]]) -> None:
        """Remember rows read in a transaction that has committed (the least recent go beyond DIGESTS_KEPT)."""
        for shard, row in read:
            if shard[2] is not None:
                self._rows[shard] = row
        while len(self._rows) > DIGESTS_KEPT:
            del self._rows[next(iter(self._rows))]


def announced(start: RoundStart) -> list[tuple[ShardKey, Mapping[str, Any]]]:
    """The digest rows a round.start stores, by shard (a round attempt announces them once, in its one round.start:
    the rows its reports would read back); none for an async version, whose tasks announce their own."""
    if start.asynchronous is not None:
        return []
    return [((start.job_id, start.round, start.attempt, shard), {"secret_digest": secret, "progress_digest": token})
            for shard, (secret, token) in store.announced_digests(start).items()]


async def forged(tx: Executor, report: WorkerReport, user_id: str | None, ts: float,
                 known: KnownDigests | None = None, read: list[tuple[ShardKey, Mapping[str, Any]]] | None = None,
                 ) -> bool:
    """Judge a worker report against its shard's digests (`known` ones, else read, and added to `read`); record it
    as forged (True) or let it through."""
    shard = shard_of(report)
    digests = None if shard is None or known is None else known.get(shard)
    if shard is not None and digests is None:
        digests = await store.shard_digest_row(tx, *shard)
        if digests is not None and read is not None:
            read.append((shard, digests))
    reason = judge(report, digests, user_id)
    if reason is None:
        return False
    await store.record_forged(tx, report, reason, ts)
    return True
