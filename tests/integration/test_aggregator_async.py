"""The aggregator's async (FedBuff) buffers on SQLite and PostgreSQL, driven by hand: each task's update is folded
once (a duplicate, a forged report, another object or an unknown task never enters a buffer), versions are
FedBuff's step over what they folded, and an aggregator that loses its memory mid-buffer (a restart) makes the
same versions, bit for bit, as one that did not, from the same arrivals."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch

from apiary import keys, proof
from apiary.bus import Delivery
from apiary.bus.identity import service_user
from apiary.bus.memory import MemoryBus
from apiary.contracts import ObjectRef, RoundAssigned, RoundStart, WorkerDone
from apiary.db import Database
from apiary.jobspec_async import AsyncConfig
from apiary.storage.local import LocalStorage
from apiary.weights import loads
from services.aggregator import Aggregator, buffers
from tests.fixtures import fedbuff
from tests.fixtures.aggregator_round import store_weights
from tests.fixtures.services import tap_aggregated

START = {"w": torch.zeros(8), "b": torch.ones(3)}


def trained(task: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(task)
    return {"w": torch.randn(8, generator=gen) * 10 ** (task % 3), "b": torch.randn(3, generator=gen)}


class Job:
    """An async job's aggregator side: its versions opened by hand, its tasks announced, their reports sent."""

    def __init__(self, aggregator: Aggregator, storage: LocalStorage, job_id: str, k: int) -> None:
        self.aggregator, self.storage, self.job_id, self.k = aggregator, storage, job_id, k
        self.secrets: dict[int, str] = {}
        self.rounds: dict[int, int] = {}  # task -> the version it trains towards

    async def start(self, num_rounds: int) -> None:
        start = await store_weights(self.storage, keys.global_weights(self.job_id, 0), START)
        settings = AsyncConfig(buffer_size=self.k, staleness_weight="polynomial").resolved(4)
        event = RoundStart(job_id=self.job_id, round=1, num_rounds=num_rounds, shards=[0, 1, 2, 3], min_workers=1,
                           weights=start, deadline=time.time() + 300, asynchronous=settings)
        await self.aggregator.on_round_start(event, Delivery("round.start", b""))

    async def assign(self, task: int, version: int, shard: int) -> None:
        """Task `task` of shard `shard` trains from the weights version `version` - 1 is."""
        self.secrets[task], self.rounds[task] = proof.new_secret(), version
        weights = await self.weights_ref(version - 1)
        event = RoundAssigned(job_id=self.job_id, round=version, attempt=task, shard=shard, weights=weights,
                              secret_digest=proof.digest(self.secrets[task]))
        await self.aggregator.on_round_assigned(event, Delivery("round.assigned", b""))

    async def weights_ref(self, version: int) -> ObjectRef:
        data = await self.storage.get_bytes(keys.global_weights(self.job_id, version))
        return ObjectRef(key=keys.global_weights(self.job_id, version), size=len(data),
                         sha256=hashlib.sha256(data).hexdigest())

    def done(self, task: int, shard: int, result: ObjectRef, *, secret: str | None = None) -> WorkerDone:
        return WorkerDone(job_id=self.job_id, round=self.rounds[task], attempt=task, shard=shard,
                          worker_id=f"w{shard}", result=result, samples=3 + task,
                          secret=self.secrets[task] if secret is None else secret)

    async def upload(self, task: int, shard: int) -> ObjectRef:
        key = keys.contribution(self.job_id, self.rounds[task], task, shard)
        return await store_weights(self.storage, key, trained(task))

    async def report(self, task: int, shard: int) -> None:
        done = self.done(task, shard, await self.upload(task, shard))
        await self.aggregator.on_worker_done(done, Delivery("worker.done", b""))

    async def statuses(self) -> list[tuple[int, int, str]]:
        rows = await self.aggregator.db.fetch("SELECT attempt, shard, status FROM contributions WHERE job_id = $1"
                                              " ORDER BY seq", self.job_id)
        return [(r["attempt"], r["shard"], r["status"]) for r in rows]

    async def version(self, index: int) -> dict[str, torch.Tensor]:
        return loads(await self.storage.get_bytes(keys.global_weights(self.job_id, index)))


async def _aggregator(database: Database, storage: LocalStorage) -> Aggregator:
    bus = MemoryBus(service_user("aggregator"))
    await bus.connect()
    aggregator = Aggregator(bus, database, storage)
    await aggregator.start()
    await tap_aggregated(bus)  # round.aggregated has a queue to go to
    return aggregator


async def test_each_update_folds_once_and_versions_are_fedbuffs(database: Database, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buffers, "TASK_WAIT", 0.2)  # an unknown task's report waits this long for its round.assigned
    storage = LocalStorage(tmp_path / "store")
    aggregator = await _aggregator(database, storage)
    job = Job(aggregator, storage, "async-once", k=2)
    await job.start(num_rounds=2)
    for task, shard in ((1, 0), (2, 1), (3, 2)):
        await job.assign(task, 1, shard)

    # Execute: task 1 reports, then again; task 2 is forged twice (wrong secret, another object) before its real
    # report; an unknown task reports; task 3 (from version 0) lands in version 2, one version stale.
    first = await job.upload(1, 0)
    await aggregator.on_worker_done(job.done(1, 0, first), Delivery("worker.done", b""))
    await aggregator.on_worker_done(job.done(1, 0, first), Delivery("worker.done", b""))
    genuine = await job.upload(2, 1)
    await aggregator.on_worker_done(job.done(2, 1, genuine, secret="guess"), Delivery("worker.done", b""))
    await aggregator.on_worker_done(job.done(2, 1, first), Delivery("worker.done", b""))
    job.rounds[9], job.secrets[9] = 1, "x"
    await aggregator.on_worker_done(job.done(9, 3, await job.upload(9, 3)), Delivery("worker.done", b""))
    await aggregator.on_worker_done(job.done(2, 1, genuine), Delivery("worker.done", b""))
    await job.assign(4, 2, 0)
    await job.report(3, 2)
    await job.report(4, 0)
    made = [await job.version(1), await job.version(2)]
    open_rows = await database.fetchval("SELECT COUNT(*) FROM aggregations WHERE job_id = $1 AND status = 'open'",
                                        job.job_id)
    await aggregator.stop()

    # Assert
    assert await job.statuses() == [(1, 0, "accepted"), (1, 0, "duplicate"), (2, 1, "forged"), (2, 1, "forged"),
                                    (9, 3, "orphan"), (2, 1, "accepted"), (3, 2, "accepted"), (4, 0, "accepted")]
    g = lambda s: fedbuff.weight("polynomial", s)  # noqa: E731
    v1 = [fedbuff.Update(trained(1), START, 4, 0), fedbuff.Update(trained(2), START, 5, 0)]
    x1 = fedbuff.fedbuff(START, [v1], g=g)[0]
    v2 = [fedbuff.Update(trained(3), START, 6, 1), fedbuff.Update(trained(4), made[0], 7, 0)]
    expected = fedbuff.fedbuff(START, [v1, v2], g=g)
    for got, want in zip(made, expected, strict=True):
        for name in want:
            torch.testing.assert_close(got[name].double(), want[name], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(made[0]["w"].double(), x1["w"], rtol=1e-6, atol=1e-6)
    assert open_rows == 0  # the last version opens no next one


async def test_a_restart_mid_buffer_makes_the_same_versions_as_no_restart(database: Database, tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "store")
    results = []
    for job_id, restart in (("async-calm", False), ("async-restarted", True)):
        aggregator = await _aggregator(database, storage)
        job = Job(aggregator, storage, job_id, k=3)
        await job.start(num_rounds=1)
        for task in (1, 2, 3):
            await job.assign(task, 1, task)
        await job.report(1, 1)
        await job.report(2, 2)
        if restart:  # the process dies (nothing stopped, nothing flushed): a new one resumes from the rows
            aggregator = await _aggregator(database, storage)
            job.aggregator = aggregator
        await job.report(3, 3)
        results.append(await job.version(1))
        await aggregator.stop()

    calm, restarted = results
    assert all(torch.equal(calm[name], restarted[name]) for name in calm)
