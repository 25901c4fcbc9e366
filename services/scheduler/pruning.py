"""Storage that does not fill up: once a round's result is stored, the contributions no round needs any more are
deleted (those of the round before it, and of the round's failed attempts), unless the job keeps them
(`distributed.transfer.keep_contributions`); the last round's stay, for an aggregator that recovers it. Halved
copies of global weights (distributed.transfer.download) other than the latest go too. Run files stay.

The contributions' keys are named, not listed: a pruning costs one delete request (and a list of the halved copies
where the job halves its downloads, an abort-list per round where its results go up in parts), not four lists. A job
whose rounds come faster than one every PRUNE_EVERY seconds is pruned once per PRUNE_EVERY (and at its last round),
for every round aggregated since (`PruneSchedule`): a delete request per round would cost its scheduler and storage
more than a sub-second round does."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from apiary import keys
from apiary.contracts import ObjectRef
from apiary.errors import DependencyUnavailable
from apiary.storage import Storage
from apiary.wire_settings import TransferSettings

log = logging.getLogger("apiary.scheduler")

PRUNE_EVERY = 2.0  # seconds: a job is pruned at most this often, and at its last round
MOST_ROUNDS_DEFERRED = 32  # rounds: ... and at least every this many rounds


@dataclass(frozen=True)
class AggregatedRound:
    """A round whose result is stored: what its pruning needs to know."""

    job_id: str
    round: int
    attempt: int  # the attempt it aggregated in
    earlier_attempts: Mapping[int, int]  # round -> how many attempts it took, for the earlier rounds to prune
    shards: Sequence[int]
    trained_from: ObjectRef  # the global weights its assignments started from
    weights: ObjectRef  # its result
    pruned_at: int | None = None  # the round the job's last pruning was at (None: the round before this one)

    @property
    def aggregated_since(self) -> range:
        """The rounds aggregated since the job's last pruning, this one included."""
        return range(self.round if self.pruned_at is None else self.pruned_at + 1, self.round + 1)


def spent_contributions(done: AggregatedRound) -> list[str]:
    """The contribution keys no round needs once `done` aggregated: every attempt's of the earlier rounds named (a
    late upload to a failed attempt included) and the round's own earlier attempts'."""
    spent = [(r, a) for r, n in sorted(done.earlier_attempts.items()) if r < done.round for a in range(1, n + 1)]
    spent += [(done.round, a) for a in range(1, done.attempt)]
    return [keys.contribution(done.job_id, r, a, s) for r, a in spent if r >= 1 for s in done.shards]


@dataclass
class PruneSchedule:
    """When each job is pruned, and the earlier rounds a pruning covers (all in memory: a scheduler that restarts,
    or a replica that did not prune the job last, covers MOST_ROUNDS_DEFERRED rounds more than it may need to, and
    deleting what is gone already costs nothing more)."""

    every: float = PRUNE_EVERY
    most_rounds: int = MOST_ROUNDS_DEFERRED
    jobs_held: int = 4096  # jobs remembered (a failed or cancelled job never has its last round): the oldest go
    _last: OrderedDict[str, tuple[int, float]] = field(default_factory=OrderedDict)  # job -> (round pruned at, when)

    def due(self, job_id: str, round_index: int, now: float, *, last: bool) -> range | None:
        """None if round `round_index`'s pruning may wait; else the earlier rounds whose every contribution is
        spent now and may still be stored (it counts as done: the next pruning starts after it)."""
        pruned, when = self._last.get(job_id, (max(0, round_index - 2 * self.most_rounds), float("-inf")))
        if not last and now - when < self.every and round_index - pruned < self.most_rounds:
            return None
        self._last.pop(job_id, None)
        if not last:
            self._last[job_id] = (round_index, now)
            while len(self._last) > self.jobs_held:
                self._last.popitem(last=False)
        return range(pruned, round_index)


async def prune_after(storage: Storage, done: AggregatedRound, transfer: TransferSettings) -> int:
    """Delete what round `done` left unneeded; how many objects went (or may have: absent ones count too). Best
    effort: storage that cannot be reached now leaves them where they are."""
    deleted = 0
    try:
        if transfer.in_parts(done.trained_from.size):
            # The rounds' assignments have ended: uploads they left incomplete hold parts nobody will complete.
            for aggregated in done.aggregated_since:
                deleted += await storage.abort_multipart(f"{keys.job_prefix(done.job_id)}rounds/{aggregated:04d}/")
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
