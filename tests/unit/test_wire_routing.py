"""Where a job halves its downloads, its assignments name the halved copy of the round's weights; pruning keeps only
what a later round or a recovering aggregator still needs."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from apiary import keys
from apiary.contracts import ObjectRef, ShardInfo
from apiary.jobspec import JobSpec
from apiary.storage.local import LocalStorage
from apiary.weights import dumps, loads
from apiary.wire_codec import load_downloaded
from services.scheduler.pruning import AggregatedRound, PruneSchedule, spent_contributions
from services.scheduler.round_plan import RoundTarget, plan_round
from services.scheduler.routing import AssignmentRouter


def _spec(transfer: dict[str, Any]) -> JobSpec:
    return JobSpec.model_validate({"name": "toy", "entrypoint": "pkg.mod:fl_train_model", "dataset": "/data",
                                   "distributed": {"max_workers": 2, "transfer": transfer}})


async def _assignments(tmp_path: Path, transfer: dict[str, Any]) -> tuple[LocalStorage, list[Any]]:
    storage = LocalStorage(tmp_path)
    weights = {"w": torch.randn(8, 8), "n": torch.tensor(3)}
    ref = await storage.put_bytes(keys.global_weights("j1", 1), dumps(weights))
    shards = [ShardInfo(index=i, key=keys.shard("j1", i), size=1, sha256="s" * 64, num_samples=4) for i in (0, 1)]
    spec = _spec(transfer)
    target = RoundTarget("j1", spec, shards, ref, round=2, attempt=1)
    router = AssignmentRouter(None, storage)  # type: ignore[arg-type]  # pool routes declare no queue
    queued = await router.assignments(target, plan_round(spec, shards, 0.0), {}, ttl=60)
    return storage, [a for a, _ in queued]


async def test_a_bf16_job_downloads_the_halved_copy(tmp_path: Path) -> None:
    storage, assignments = await _assignments(tmp_path, {"download": "bf16", "upload": "int8_blockwise",
                                                         "delta": True})

    halved = await storage.list("jobs/j1/wire/")
    assert len(halved) == 1
    data = await storage.get_bytes(halved[0])
    assert {a.weights_url for a in assignments} == {storage.presign_get(halved[0], 60)}
    assert {a.weights_sha256 for a in assignments} == {hashlib.sha256(data).hexdigest()}
    assert loads(data)["w"].dtype == torch.bfloat16
    assert load_downloaded(data)["w"].dtype == torch.float32
    assert all(a.transfer is not None and a.transfer.upload == "int8_blockwise" for a in assignments)


async def test_a_default_job_downloads_the_fp32_weights_and_carries_no_transfer(tmp_path: Path) -> None:
    storage, assignments = await _assignments(tmp_path, {})

    assert await storage.list("jobs/j1/wire/") == []
    assert {a.weights_url for a in assignments} == {storage.presign_get(keys.global_weights("j1", 1), 60)}
    assert all(a.transfer is None for a in assignments)


def test_pruning_names_every_spent_contribution_and_spares_the_aggregated_attempt() -> None:
    weights = ObjectRef(key=keys.global_weights("j", 2), size=10, sha256="0" * 64)
    done = AggregatedRound("j", round=3, attempt=2, earlier_attempts={2: 2}, shards=[0, 1], trained_from=weights,
                           weights=weights)

    spent = spent_contributions(done)

    # Round 2's two attempts (a late upload to its failed one too) and round 3's failed first attempt; never
    # round 3's aggregated attempt 2, whose contributions an aggregator that recovers reads again.
    assert sorted(spent) == sorted(keys.contribution("j", r, a, s) for r, a in ((2, 1), (2, 2), (3, 1)) for s in (0, 1))


def test_round_one_has_no_round_before_it_to_prune() -> None:
    weights = ObjectRef(key=keys.global_weights("j", 1), size=10, sha256="0" * 64)

    assert spent_contributions(AggregatedRound("j", 1, 1, {}, [0, 1, 2], weights, weights)) == []


def test_a_pruning_deferred_over_rounds_names_every_attempt_of_each_of_them() -> None:
    weights = ObjectRef(key=keys.global_weights("j", 5), size=10, sha256="0" * 64)
    done = AggregatedRound("j", round=5, attempt=1, earlier_attempts={2: 1, 3: 2, 4: 1}, shards=[0],
                           trained_from=weights, weights=weights)

    assert sorted(spent_contributions(done)) == sorted(keys.contribution("j", r, a, 0)
                                                       for r, a in ((2, 1), (3, 1), (3, 2), (4, 1)))
    assert list(done.aggregated_since) == [5]  # pruned at round 4: its incomplete uploads were aborted then
    assert list(replace(done, pruned_at=2).aggregated_since) == [3, 4, 5]


def test_a_job_is_pruned_once_per_interval_over_every_round_since_and_always_at_its_last_round() -> None:
    schedule = PruneSchedule(every=2.0, most_rounds=4)

    assert schedule.due("j", 1, now=100.0, last=False) == range(0, 1)  # a job's first pruning: nothing before
    assert schedule.due("j", 2, now=100.5, last=False) is None  # within the interval: it waits
    assert schedule.due("j", 3, now=101.0, last=False) is None
    assert schedule.due("j", 4, now=102.0, last=False) == range(1, 4)  # rounds 1..3 spent, round 4's kept
    assert schedule.due("j", 5, now=102.1, last=True) == range(4, 5)  # the last round never waits
    assert schedule.due("k", 1, now=0.0, last=False) == range(0, 1)
    assert [schedule.due("k", r, now=0.1, last=False) for r in (2, 3, 4)] == [None, None, None]
    assert schedule.due("k", 5, now=0.2, last=False) == range(1, 5)  # at most `most_rounds` rounds wait


def test_a_scheduler_that_does_not_know_a_jobs_last_pruning_covers_every_round_one_may_have_deferred() -> None:
    # A restarted scheduler (or a replica that did not prune the job last): the rounds deferred before it took
    # over are at most `most_rounds`, all covered; deleting what is gone already is harmless.
    assert PruneSchedule(every=2.0, most_rounds=4).due("j", 20, now=0.0, last=False) == range(12, 20)


def test_the_schedule_forgets_the_oldest_jobs_beyond_those_it_holds() -> None:
    schedule = PruneSchedule(every=2.0, most_rounds=4, jobs_held=2)
    for job in ("a", "b", "c"):  # jobs that never reach their last round (failed, cancelled)
        schedule.due(job, 10, now=0.0, last=False)

    assert schedule.due("a", 11, now=0.1, last=False) == range(3, 11)  # forgotten: covered as after a restart
    assert schedule.due("c", 11, now=0.1, last=False) is None  # remembered: it waits


class _PartsStore(LocalStorage):
    """A local store that says how many parts each multipart upload was opened with."""

    opened: list[int] = []

    async def start_multipart(self, key: str, parts: int, part_size: int, expires: int) -> Any:
        self.opened.append(parts)
        return None


async def test_multipart_uploads_are_planned_for_the_fp32_result_even_when_downloads_are_halved(tmp_path: Path) -> None:
    storage = _PartsStore(tmp_path)
    weights = {"w": torch.randn(3 * 2**20)}  # 12 MiB
    ref = await storage.put_bytes(keys.global_weights("j1", 1), dumps(weights))
    shards = [ShardInfo(index=0, key=keys.shard("j1", 0), size=1, sha256="s" * 64, num_samples=4)]
    spec = _spec({"download": "bf16", "part_size_mib": 5})
    router = AssignmentRouter(None, storage)  # type: ignore[arg-type]

    await router.assignments(RoundTarget("j1", spec, shards, ref, round=2, attempt=1), plan_round(spec, shards, 0.0),
                             {}, ttl=60)

    assert storage.opened == [4]  # 12 MiB + 10% in parts of 5 MiB, and one more; not the 6 MiB halved copy's 3
