"""How a round starts, as pure functions: whether enough workers are online, where each shard goes,
the round's deadline, and the fields of the messages that start it."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from apiary import keys, proof
from apiary.contracts import Assignment, ModelRef, MultipartUpload, ObjectRef, RoundStart, ShardInfo
from apiary.jobspec import JobSpec
from apiary.secagg.crypto import round_context, verify_keys_of
from apiary.strategies.format import UpdateFormat
from apiary.wire_settings import TransferSettings

# The weights of a job whose round 0 (its init task, on a worker) has not made them yet.
NO_WEIGHTS = ObjectRef(key="", size=0, sha256="")


@dataclass(frozen=True)
class RoundTarget:
    """What a round trains: the job, its shards, the weights it starts from, its round and attempt."""

    job_id: str
    spec: JobSpec
    shards: list[ShardInfo]
    weights: ObjectRef
    round: int
    attempt: int


@dataclass(frozen=True)
class Waiting:
    """Why a round cannot start yet: the workers that count as online for the job, and how many it needs."""

    online: int
    required: int
    reason: str


@dataclass(frozen=True)
class RoundPlan:
    """A round about to start: the shards it trains, when it starts, its timeout and its deadline."""

    chosen: list[ShardInfo]
    started_at: float
    timeout: float
    deadline: float
    # Each chosen shard's one-time secret: in its assignment only; round.start carries their digests.
    secrets: dict[int, str] = field(default_factory=dict, repr=False)


class Queue(enum.Enum):
    """Which kind of queue an assignment goes to."""

    PINNED = "pinned"  # the worker the shard's data lives with
    PREFERRED = "preferred"  # the worker that trained the shard last round (its data is cached there)
    POOL = "pool"  # any worker


@dataclass(frozen=True)
class Route:
    """Where one assignment goes: a kind of queue and, unless it is the pool, its worker."""

    queue: Queue
    worker: str | None = None


@dataclass(frozen=True)
class AssignmentUrls:
    """The presigned URLs an assignment carries, so its worker needs no storage credentials."""

    shard: str
    weights: str
    upload: str
    files_upload: str
    ended: str
    base_model: ModelRef | None = None  # a built-in job's registered model, presigned
    multipart: MultipartUpload | None = None  # a large result's multipart upload, presigned part by part


def workers_needed(min_workers: int, pinned: list[str], online: set[str]) -> tuple[int, int]:
    """(workers that count as online for the job, how many it needs) before a round may start.

    A pinned job counts only its own workers, since its shards train nowhere else.
    """
    usable = online & set(pinned) if pinned else online
    return len(usable), min_workers


def waiting_for_workers(min_workers: int, pinned: list[str], online: set[str],
                        wrong: Mapping[str, str] | None = None) -> Waiting | None:
    """Why the round must wait for workers (naming listed ones of the wrong kind), or None when enough are
    online to start it."""
    count, required = workers_needed(min_workers, pinned, online)
    if count >= required:
        return None
    which = f" of its pinned workers {pinned}" if pinned else ""
    why = "".join(f"; {reason}" for reason in (wrong or {}).values())
    return Waiting(count, required, f"waiting for workers: {count}{which} online, min_workers is {required}{why}")


def wrong_kinds(kinds: Mapping[str, str], online: Mapping[str, str | None]) -> dict[str, str]:
    """The listed workers online with another kind than the job lists them as (mixed selection): each
    with why it does not count. Such a worker gets no assignment; its shard is absent, as if it were away."""
    return {worker: f"worker {worker} is {online[worker] or 'of no declared kind'}, listed as {wanted}"
            for worker, wanted in kinds.items() if worker in online and online[worker] != wanted}


def usable_workers(online: Mapping[str, str | None], kinds: Mapping[str, str]) -> tuple[set[str], dict[str, str]]:
    """The online workers that count for the job (a listed one only of its listed kind), and the listed ones
    that do not, with why."""
    wrong = wrong_kinds(kinds, online)
    return set(online) - set(wrong), wrong


def online_preferences(prefer: Mapping[int, str] | None, online: set[str]) -> dict[int, str]:
    """The shards' preferred workers (who trained each last round), keeping only those online."""
    return {shard: worker for shard, worker in (prefer or {}).items() if worker in online}


def plan_round(spec: JobSpec, shards: list[ShardInfo], now: float) -> RoundPlan:
    """The round's shards (at most `max_workers`) and its deadline, `aggregation_timeout` from now."""
    timeout = spec.distributed.aggregation_timeout
    chosen = shards[: spec.distributed.max_workers]
    return RoundPlan(chosen=chosen, started_at=now, timeout=timeout, deadline=now + timeout,
                     secrets={s.index: proof.new_secret() for s in chosen})


def url_lifetime(plan: RoundPlan, presign_ttl: int) -> int:
    """Seconds an assignment's URLs stay valid: past the round's timeout by the configured lifetime."""
    return int(plan.timeout + presign_ttl)


def route(shard: int, pinned: list[str], prefer: Mapping[int, str]) -> Route:
    """A pinned shard goes to its worker; one trained last round by an online worker to that worker
    (the pool takes it if that worker is busy or gone); any other to the pool."""
    worker = pinned[shard] if pinned else None
    if worker:
        return Route(Queue.PINNED, worker)
    if shard in prefer:
        return Route(Queue.PREFERRED, prefer[shard])
    return Route(Queue.POOL)


def round_start(target: RoundTarget, plan: RoundPlan) -> RoundStart:
    """The round.start event: what the aggregator needs to collect the round."""
    spec = target.spec
    return RoundStart(
        job_id=target.job_id, round=target.round, attempt=target.attempt, num_rounds=spec.distributed.num_rounds,
        shards=[s.index for s in plan.chosen], min_workers=spec.distributed.min_workers, weights=target.weights,
        # Personal layers never travel to the aggregator: a round's updates are then the model's other tensors.
        deadline=plan.deadline,
        update_format=UpdateFormat.of(adapter_only=spec.adapter_only or bool(spec.distributed.personal_layers)),
        strategy=spec.distributed.strategy, strategy_params=spec.distributed.strategy_params,
        differential_privacy=spec.distributed.differential_privacy,
        secret_digests={shard: proof.digest(secret) for shard, secret in plan.secrets.items()},
        progress_digests={shard: proof.digest(proof.progress_token(secret)) for shard, secret in plan.secrets.items()},
        secure_aggregation=spec.distributed.secure_aggregation, secagg_verify_keys=secagg_verify_keys(target, plan),
    )


def assignment(target: RoundTarget, plan: RoundPlan, shard: ShardInfo, urls: AssignmentUrls) -> Assignment:
    """One shard's assignment for the round."""
    spec = target.spec
    pinned = spec.worker_selection.pinned
    return Assignment(
        job_id=target.job_id, round=target.round, attempt=target.attempt, job_name=spec.name,
        num_rounds=spec.distributed.num_rounds, shard=shard.index, num_shards=len(target.shards),
        shard_num_samples=shard.num_samples, shard_url=urls.shard, shard_sha256=shard.sha256,
        weights_url=urls.weights, weights_sha256=target.weights.sha256, upload_url=urls.upload,
        result_key=keys.contribution(target.job_id, target.round, target.attempt, shard.index),
        files_upload_url=urls.files_upload, entrypoint=spec.entrypoint, trainer=spec.trainer,
        base_model=urls.base_model, env=spec.env(target.round),
        deadline=plan.deadline, pinned_worker=pinned[shard.index] if pinned else None,
        issued_at=plan.started_at, ended_url=urls.ended, secret=plan.secrets.get(shard.index),
        clipping_norm=worker_clipping_norm(spec), **worker_noise(spec, target.round, target.attempt, shard.index),
        secure_aggregation=spec.distributed.secure_aggregation, secagg_verify_keys=secagg_verify_keys(target, plan),
        transfer=wire_transfer(spec), weights_size=target.weights.size, multipart=urls.multipart,
    )


def secagg_verify_keys(target: RoundTarget, plan: RoundPlan) -> dict[int, str]:
    """Each shard's secure-aggregation verify key (hex), derived from its secret; none without secure aggregation."""
    if target.spec.distributed.secure_aggregation is None:
        return {}
    return verify_keys_of(plan.secrets, round_context(target.job_id, target.round, target.attempt))


def wire_transfer(spec: JobSpec) -> TransferSettings | None:
    """The job's `distributed.transfer` for its assignments, where it is not the default (None: plain fp32)."""
    settings = spec.distributed.transfer
    return settings if settings != TransferSettings() else None


def worker_noise(spec: JobSpec, round_index: int, attempt: int, shard: int) -> dict[str, Any]:
    """What a task carries for the noise its worker adds (differential privacy with noise_on worker): the std, and
    the seed of this task's noise where the job sets the test-only `seed` (each task's its own)."""
    settings = spec.distributed.differential_privacy
    std = 0.0 if settings is None else settings.worker_noise_std
    if settings is None or std <= 0:
        return {}
    if settings.seed is None:
        return {"noise_std": std}
    material = f"{settings.seed}/{round_index}/{attempt}/{shard}".encode()
    return {"noise_std": std, "noise_seed": int.from_bytes(hashlib.sha256(material).digest()[:8], "big") >> 1}


def worker_clipping_norm(spec: JobSpec) -> float | None:
    """The norm a worker clips its update to before upload (differential privacy with clip_on worker), else None."""
    settings = spec.distributed.differential_privacy
    return settings.clipping_norm if settings is not None and settings.clip_on == "worker" else None
