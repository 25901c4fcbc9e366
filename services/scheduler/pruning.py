"""Storage that does not fill up: once a round's result is stored, the contributions no round needs any more are
deleted (those of the round before it, and of the round's failed attempts), unless the job keeps them
(`distributed.transfer.keep_contributions`); the last round's stay, for an aggregator that recovers it. Halved
copies of global weights (distributed.transfer.download) other than the latest go too. Run files stay."""

from __future__ import annotations

import logging
import re

from apiary import keys
from apiary.errors import DependencyUnavailable
from apiary.storage import Storage

log = logging.getLogger("apiary.scheduler")

_CONTRIBUTION = re.compile(r"/rounds/(\d+)/attempt-(\d+)/shard-\d+\.safetensors$")


def stale_contributions(listed: list[str], round_index: int, attempt: int) -> list[str]:
    """The contribution keys among `listed` that no round needs once `round_index` aggregated in `attempt`."""
    stale = []
    for key in listed:
        found = _CONTRIBUTION.search(key)
        if found is None:
            continue
        at, tried = int(found[1]), int(found[2])
        if at < round_index or (at == round_index and tried != attempt):
            stale.append(key)
    return stale


async def prune_after(storage: Storage, job_id: str, round_index: int, attempt: int, weights_sha256: str, *,
                      keep_contributions: bool) -> int:
    """Delete what round `round_index` (aggregated in `attempt` into weights `weights_sha256`) left unneeded;
    how many objects went. Best effort: storage that cannot be reached now leaves them for the next round."""
    deleted = 0
    try:
        # The round's assignments have ended: uploads they left incomplete hold parts nobody will complete.
        deleted += await storage.abort_multipart(f"{keys.job_prefix(job_id)}rounds/{round_index:04d}/")
        stale: list[str] = []
        if not keep_contributions:
            for back in (round_index - 1, round_index):
                if back < 1:
                    continue
                listed = await storage.list(f"{keys.job_prefix(job_id)}rounds/{back:04d}/")
                stale += stale_contributions(listed, round_index, attempt)
        halved = await storage.list(f"{keys.job_prefix(job_id)}wire/")
        stale += [key for key in halved if weights_sha256[:32] not in key]
        await storage.delete_many(stale)  # one request for them all on S3
        deleted += len(stale)
    except (DependencyUnavailable, OSError) as e:
        log.warning("job %s: round %d's stale contributions are left in storage for now: %s", job_id, round_index, e)
    return deleted


async def abort_uploads(storage: Storage, job_id: str, round_index: int, attempt: int) -> int:
    """Abort the multipart uploads a failed attempt's assignments left incomplete; how many. Best effort."""
    try:
        return await storage.abort_multipart(f"{keys.job_prefix(job_id)}rounds/{round_index:04d}/attempt-{attempt}/")
    except (DependencyUnavailable, OSError) as e:
        log.warning("job %s: round %d's incomplete uploads are left for now: %s", job_id, round_index, e)
        return 0
