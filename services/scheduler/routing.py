"""The edge of a round's assignments: presigned URLs for their objects, and the worker queues they go to."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from apiary import bundle_store, keys
from apiary.assignments import POOL, declare_preferred, pinned_queue, preferred_queue
from apiary.bus import Bus
from apiary.contracts import Assignment, ModelRef, MultipartUpload, ShardInfo
from apiary.jobspec import JobSpec
from apiary.registry import dataset_info, model_info, model_ref
from apiary.storage import Storage
from apiary.transfer_parts import planned_parts
from services.scheduler.halved import HalvedWeights
from services.scheduler.round_plan import (
    AssignmentUrls,
    Queue,
    RoundPlan,
    RoundTarget,
    Route,
    assignment,
    route,
)

DECLARE_EVERY = 300.0  # seconds between declarations of one worker queue by this process


class AssignmentRouter:
    """Signs the URLs an assignment carries and names (declaring when due) the queue it is sent to."""

    def __init__(self, bus: Bus, storage: Storage) -> None:
        self._bus, self._storage = bus, storage
        self._declared: dict[str, float] = {}  # worker queue -> when this process last declared it
        self._halved = HalvedWeights(storage)

    async def assignments(self, target: RoundTarget, plan: RoundPlan, prefer: Mapping[int, str],
                          ttl: int) -> list[tuple[Assignment, str]]:
        """Each chosen shard's assignment, with URLs valid for `ttl` seconds, and its routing key."""
        precision = target.spec.distributed.transfer.download
        full_size = target.weights.size  # a result is about the fp32 weights' size, whatever is downloaded
        if precision != "fp32" and target.weights.key:  # the workers fetch the global weights halved
            target = replace(target, weights=await self._halved.copy(target.job_id, target.weights, precision))
        ended_url = self._storage.presign_get(keys.job_ended(target.job_id), ttl)
        base_model = await self.base_model(target.spec, ttl)
        pinned = target.spec.worker_selection.pinned
        code = self.code(target.spec, ttl)
        queued = []
        for shard in plan.chosen:
            urls = replace(self.urls(target, shard, ttl, ended_url), base_model=base_model,
                           multipart=await self.multipart(target, shard, ttl, full_size))
            message = assignment(target, plan, shard, urls).model_copy(update=code)
            queued.append((message, await self.queue(route(shard.index, pinned, prefer))))
        return queued

    async def multipart(self, target: RoundTarget, shard: ShardInfo, ttl: int,
                        expected: int) -> MultipartUpload | None:
        """A multipart upload for the shard's result (`expected` bytes, about), where it takes more than one part
        and the store takes parts (S3): presigned for `ttl` seconds, with room for a result a little larger."""
        transfer = target.spec.distributed.transfer
        if not transfer.in_parts(expected):
            return None
        part_size = transfer.part_size_mib * 2**20
        key = keys.contribution(target.job_id, target.round, target.attempt, shard.index)
        return await self._storage.start_multipart(key, planned_parts(expected, part_size), part_size, ttl)

    async def base_model(self, spec: JobSpec, ttl: int) -> ModelRef | None:
        """A built-in job's registered model, presigned for `ttl` seconds; None for user code."""
        if spec.trainer is None or spec.model_id is None:
            return None
        return model_ref(self._storage, await model_info(self._storage, spec.model_id), ttl)

    async def evaluation_inputs(self, spec: JobSpec, ttl: int) -> dict[str, Any]:
        """What a built-in job's evaluate assignment carries beside the weights, presigned for `ttl` seconds:
        its base model, and its held-out dataset (`eval_dataset_id`) in the shard's fields; none for user code."""
        cfg = spec.built_in
        if cfg is None or cfg.eval_dataset_id is None or spec.model_id is None:
            return {}
        held_out = await dataset_info(self._storage, cfg.eval_dataset_id)
        return {"base_model": model_ref(self._storage, await model_info(self._storage, spec.model_id), ttl),
                "shard_url": self._storage.presign_get(held_out["key"], ttl), "shard_sha256": held_out["sha256"],
                "shard_num_samples": held_out["num_samples"]}

    def code(self, spec: JobSpec, ttl: int) -> dict[str, Any]:
        """What every assignment of a job carries for its code, whatever its task: the bundle (URL presigned
        for `ttl` seconds) and the requirements its worker must meet."""
        return {"code": bundle_store.for_assignment(self._storage, spec.code, ttl),
                "requirements": spec.requirements}

    def urls(self, target: RoundTarget, shard: ShardInfo, ttl: int, ended_url: str) -> AssignmentUrls:
        """The presigned URLs of one shard's assignment, valid for `ttl` seconds."""
        job_id, round_index, attempt = target.job_id, target.round, target.attempt
        return AssignmentUrls(
            shard=self._storage.presign_get(shard.key, ttl),
            weights=self._storage.presign_get(target.weights.key, ttl),
            upload=self._storage.presign_put(keys.contribution(job_id, round_index, attempt, shard.index), ttl),
            files_upload=self._storage.presign_put(keys.run_files(job_id, round_index, attempt, shard.index), ttl),
            ended=ended_url,
        )

    async def queue(self, route: Route) -> str:
        """The routing key for an assignment that takes this route."""
        if route.queue is Queue.POOL or route.worker is None:
            return POOL
        return await self._declare_worker_queue(route.worker, preferred=route.queue is Queue.PREFERRED)

    async def _declare_worker_queue(self, worker: str, *, preferred: bool) -> str:
        """The worker's pinned (or preferred) queue, made sure to exist before an assignment is queued
        there (the worker may not have started yet): declared at most every few minutes, not every
        round. A preferred queue is deleted only after an hour without a consumer, and only online
        workers are preferred."""
        queue = preferred_queue(worker) if preferred else pinned_queue(worker)
        now = time.monotonic()
        if now - self._declared.get(queue, -DECLARE_EVERY) >= DECLARE_EVERY:
            if preferred:
                await declare_preferred(self._bus, worker)
            else:
                await self._bus.declare_queue(queue, [queue])
            self._declared[queue] = now
        return queue

