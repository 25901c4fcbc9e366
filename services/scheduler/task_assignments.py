"""A job's init, evaluate and merge tasks: assignments for a worker (the job's code runs there, and a built-in
job's base model loads there, never here) with their presigned URLs and queue, and the delayed timeout after
which the scheduler stops waiting for them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from apiary import keys, proof
from apiary.contracts import EVALUATE, INIT, MERGE, Assignment, ObjectRef, ShardInfo, TaskKind, TaskTimeout
from apiary.jobspec import JobSpec
from apiary.outbox import Pending
from apiary.storage import Storage
from services.scheduler.builtin import merged_upload
from services.scheduler.evaluation import task_timeout, task_worker
from services.scheduler.round_plan import Queue, Route
from services.scheduler.routing import AssignmentRouter


class TaskQueue:
    """Makes a job's init, evaluate and merge assignments and the events that queue them."""

    def __init__(self, storage: Storage, router: AssignmentRouter, presign_ttl: int) -> None:
        self._storage, self._router, self._presign_ttl = storage, router, presign_ttl

    async def init(self, job_id: str, spec: JobSpec, attempt: int, online: set[str], now: float) -> list[Pending]:
        """Round 0: a worker runs the module's fl_init_weights (a built-in job: reads its base model's weights)
        and uploads the result as round 1's weights."""
        target = keys.global_weights(job_id, 0)
        ttl = int(task_timeout(spec) + self._presign_ttl)
        return await self._queued(job_id, spec, INIT, 0, attempt, online, now,
                                  upload_url=self._storage.presign_put(target, ttl), result_key=target,
                                  env=spec.env(0), base_model=await self._router.base_model(spec, ttl))

    async def merge(self, job_id: str, spec: JobSpec, round_index: int, adapter: ObjectRef, online: set[str],
                    now: float) -> list[Pending]:
        """After a built-in job's last round: a worker merges the final adapter (round `round_index`'s) into the
        base model in its cache and uploads the merged model folder as one zip."""
        target = merged_upload(job_id)
        ttl = int(task_timeout(spec) + self._presign_ttl)
        return await self._queued(job_id, spec, MERGE, round_index, 1, online, now,
                                  weights_url=self._storage.presign_get(adapter.key, ttl),
                                  weights_sha256=adapter.sha256, upload_url=self._storage.presign_put(target, ttl),
                                  result_key=target, env=spec.env(round_index),
                                  base_model=await self._router.base_model(spec, ttl))

    async def evaluate(self, job_id: str, spec: JobSpec, round_index: int, attempt: int, weights: ObjectRef,
                       online: set[str], now: float) -> list[Pending]:
        """A worker evaluates the round's global weights with the module's fl_evaluate_model."""
        ttl = int(task_timeout(spec) + self._presign_ttl)
        return await self._queued(job_id, spec, EVALUATE, round_index, attempt, online, now,
                                  weights_url=self._storage.presign_get(weights.key, ttl),
                                  weights_sha256=weights.sha256, env=spec.env(round_index),
                                  **await self._router.evaluation_inputs(spec, ttl))

    async def evaluate_shards(self, job_id: str, spec: JobSpec, round_index: int, attempt: int, weights: ObjectRef,
                              shards: Sequence[ShardInfo], states: Mapping[int, ObjectRef], online: set[str],
                              now: float) -> list[Pending]:
        """A personal-layers job: one evaluate assignment a shard, each scoring the round's global weights with the
        shard's personal layers (its state as the round left it) on a worker that fetches the shard's data (a
        pinned shard's own worker)."""
        ttl = int(task_timeout(spec) + self._presign_ttl)
        pinned = spec.worker_selection.pinned
        queued: list[Pending] = []
        for shard in shards:
            state = states.get(shard.index)
            queued += await self._queued(
                job_id, spec, EVALUATE, round_index, attempt, online, now,
                worker=pinned[shard.index] if pinned else None,
                weights_url=self._storage.presign_get(weights.key, ttl), weights_sha256=weights.sha256,
                env=spec.env(round_index), shard=shard.index, num_shards=len(shards),
                shard_num_samples=shard.num_samples, shard_url=self._storage.presign_get(shard.key, ttl),
                shard_sha256=shard.sha256, personal_layers=list(spec.distributed.personal_layers),
                state_url=self._storage.presign_get(state.key, ttl) if state else "",
                state_sha256=state.sha256 if state else "")
        return queued

    async def _queued(self, job_id: str, spec: JobSpec, task: TaskKind, round_index: int, attempt: int,
                      online: set[str], now: float, worker: str | None = None, **fields: object) -> list[Pending]:
        """The assignment on its queue (to `worker`, or the job's task worker), then its delayed timeout."""
        timeout = task_timeout(spec)
        worker = worker or task_worker(spec, online, round_index)
        ended = self._storage.presign_get(keys.job_ended(job_id), int(timeout + self._presign_ttl))
        assignment = Assignment.model_validate({
            "task": task, "job_id": job_id, "round": round_index, "attempt": attempt, "job_name": spec.name,
            "num_rounds": spec.distributed.num_rounds, "entrypoint": spec.entrypoint, "trainer": spec.trainer,
            "deadline": now + timeout, "issued_at": now, "ended_url": ended, "pinned_worker": worker, **fields,
            # What its worker's report must present (the scheduler keeps only its digest: task_proofs).
            "secret": proof.new_secret(),
            # The job's code bundle and requirements, as its training assignments carry them.
            **self._router.code(spec, int(timeout + self._presign_ttl)),
        })
        queue = await self._router.queue(Route(Queue.PINNED, worker) if worker else Route(Queue.POOL))
        expire = TaskTimeout(job_id=job_id, round=round_index, attempt=attempt, task=task)
        return [Pending(assignment, routing_key=queue), Pending(expire, delay=timeout)]
