"""Where the aggregator's secure-aggregation stages for this worker wait for the run of the shard they name
(services.worker.secure_rounds): they come on the worker's control queue, as `secagg.worker.<id>`."""

from __future__ import annotations

import asyncio
import logging

from apiary.bus import Delivery
from apiary.contracts import SecAggStage

log = logging.getLogger("apiary.worker")

StageKey = tuple[str, int, int, int]  # (job, round, attempt, shard)


class SecAggInbox:
    """The aggregator's stages for the shards this worker runs, each queued for its shard's run."""

    def __init__(self) -> None:
        self._queues: dict[StageKey, asyncio.Queue[SecAggStage]] = {}
        # One shard's update masked at a time here: masking holds the update in float64 (8 bytes a value) beside
        # its mask, so a worker whose several trained shards get the round's shares at once masks them in turn.
        self.masking = asyncio.Lock()

    def open(self, key: StageKey) -> asyncio.Queue[SecAggStage]:
        """Start keeping the stages of one shard's run."""
        return self._queues.setdefault(key, asyncio.Queue())

    def close(self, key: StageKey) -> None:
        """Stop keeping them (the run ended)."""
        self._queues.pop(key, None)

    async def on_stage(self, event: SecAggStage, delivery: Delivery) -> None:
        """A stage for one of this worker's shards; one for a run that ended (or never ran here) is dropped."""
        queue = self._queues.get((event.job_id, event.round, event.attempt, event.shard))
        if queue is None:
            log.info("secure aggregation: a %s stage for job %s round %d shard %d no run here waits for: dropped",
                     event.stage, event.job_id, event.round, event.shard)
            return
        queue.put_nowait(event)
