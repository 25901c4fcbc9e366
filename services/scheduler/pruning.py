"""Storage that does not fill up: once a round's result is stored, the contributions no round needs any more are
deleted (those of the round before it, and of the round's failed attempts), unless the job keeps them
(`distributed.transfer.keep_contributions`); the last round's stay, for an aggregator that recovers it. Halved
copies of global weights (distributed.transfer.download) other than the latest go too. Run files stay.

The contributions' keys are named, not listed: a round costs one delete request (and a list of the halved copies
where the job halves its downloads, an abort-list where its results go up in parts), not four lists."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from apiary import keys
from apiary.contracts import ObjectRef
from apiary.errors import DependencyUnavailable
from apiary.storage import Storage
from apiary.wire_settings import TransferSettings

log = logging.getLogger("apiary.scheduler")


@dataclass(frozen=True)
class AggregatedRound:
    """A round whose result is stored: what its pruning needs to know."""

    job_id: str
    round: int
    attempt: int  # the attempt it aggregated in
    previous_attempts: int  # how many attempts the round before it took (0 for round 1)
    shards: Sequence[int]
    trained_from: ObjectRef  # the global weights its assignments started from
    weights: ObjectRef  # its result


def spent_contributions(done: AggregatedRound) -> list[str]:
    """The contribution keys no round needs once `done` aggregated: every attempt's of the round before (a late
    upload to a failed attempt included) and the round's own earlier attempts'."""
    spent = [(done.round - 1, a) for a in range(1, done.previous_attempts + 1)]
    spent += [(done.round, a) for a in range(1, done.attempt)]
    return [keys.contribution(done.job_id, r, a, s) for r, a in spent if r >= 1 for s in done.shards]


async def prune_after(storage: Storage, done: AggregatedRound, transfer: TransferSettings) -> int:
    """Delete what round `done` left unneeded; how many objects went (or may have: absent ones count too). Best
    effort: storage that cannot be reached now leaves them where they are."""
    deleted = 0
    try:
        if transfer.in_parts(done.trained_from.size):
            # The round's assignments have ended: uploads they left incomplete hold parts nobody will complete.
            deleted += await storage.abort_multipart(f"{keys.job_prefix(done.job_id)}rounds/{done.round:04d}/")
        stale = [] if transfer.keep_contributions else spent_contributions(done)
        if transfer.download != "fp32":
            halved = await storage.list(f"{keys.job_prefix(done.job_id)}wire/")
            stale += [key for key in halved if done.weights.sha256[:32] not in key]
        await storage.delete_many(stale)  # one request for them all on S3
        deleted += len(stale)
    except (DependencyUnavailable, OSError) as e:
        log.warning("job %s: round %d's stale contributions are left in storage for now: %s", done.job_id,
                    done.round, e)
    return deleted


async def abort_uploads(storage: Storage, job_id: str, round_index: int, attempt: int) -> int:
    """Abort the multipart uploads a failed attempt's assignments left incomplete; how many. Best effort."""
    try:
        return await storage.abort_multipart(f"{keys.job_prefix(job_id)}rounds/{round_index:04d}/attempt-{attempt}/")
    except (DependencyUnavailable, OSError) as e:
        log.warning("job %s: round %d's incomplete uploads are left for now: %s", job_id, round_index, e)
        return 0
