"""Two aggregator replicas share a round's reports (SQLite and PostgreSQL): the one whose report settles the
last shard closes the round holding every contribution. Where the strategy's result does not depend on the
order (FedAvg's float64 sum) it folds only those the other replica took, each read once; where it does (a sum
kept in float32), it re-folds the round in the stored order, so any replica closing gives the same bits."""

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
from apiary.contracts import ObjectRef, RoundAggregated, RoundStart, WorkerDone, decode
from apiary.db import Database
from apiary.storage.local import LocalStorage
from apiary.strategies import weighted_sum
from apiary.strategies.weighted_sum import WeightedSum
from apiary.weights import dumps, loads
from services.aggregator import Aggregator

JOB = "replicas"
SAMPLES = [296, 637, 504, 75, 1, 33]
# Which replica each shard's report reaches, in this order (competing consumers of the aggregator queue):
# the second replica first hears of the round with shard 1, after the first accepted shard 0.
ARRIVALS = [("a", 0), ("b", 1), ("a", 2), ("b", 3), ("a", 4), ("b", 5)]


class CountingStorage(LocalStorage):
    """A local folder that counts how often each object is read (one replica's view of the shared store)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: dict[str, int] = {}

    async def get_bytes(self, key: str) -> bytes:
        self.reads[key] = self.reads.get(key, 0) + 1
        return await super().get_bytes(key)


def contributions() -> list[dict[str, torch.Tensor]]:
    """Six workers' weights with values far apart in magnitude, where a float32 sum shows its order."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(64, generator=gen)
    out = []
    for i in range(len(SAMPLES)):
        w = base + torch.randn(64, generator=gen) * 0.01
        w[:6] = torch.tensor([1e4, -1e4, 1e-6, -1e-6, 3.0, -0.1]) * (i + 1)
        out.append({"w": w})
    return out


def folded(order: list[int], wide: bool) -> bytes:
    total = WeightedSum(wide=wide)
    for i in order:
        total.fold(contributions()[i], SAMPLES[i])
    return total.finish()["w"].numpy().tobytes()


async def _stored(storage: LocalStorage, key: str, weights: dict[str, torch.Tensor]) -> ObjectRef:
    data = dumps(weights)
    await storage.put_bytes(key, data)
    return ObjectRef(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())


async def _run_round(database: Database, tmp_path: Path) -> tuple[bytes, dict[str, CountingStorage], list[int]]:
    """One round of six shards reported to two replicas; the new weights' bits, each replica's store and the
    contributors of each round.aggregated published."""
    bus = MemoryBus(service_user("aggregator"))
    await bus.connect()
    shared = LocalStorage(tmp_path / "store")
    stores = {name: CountingStorage(tmp_path / "store") for name in "ab"}
    replicas = {name: Aggregator(bus, database, store) for name, store in stores.items()}
    for replica in replicas.values():
        await replica.start()
    announced: list[int] = []

    async def tap(delivery: Delivery) -> None:
        event = decode(delivery.routing_key, delivery.body)
        assert isinstance(event, RoundAggregated)
        announced.append(len(event.contributors))

    await bus.declare_queue("tap", ["round.aggregated"])
    await bus.consume("tap", tap)
    secrets = {shard: proof.new_secret() for shard in range(len(SAMPLES))}
    start = RoundStart(job_id=JOB, round=1, num_rounds=1, shards=list(secrets), min_workers=len(SAMPLES),
                       weights=await _stored(shared, keys.global_weights(JOB, 0), {"w": torch.zeros(64)}),
                       deadline=time.time() + 300,
                       secret_digests={shard: proof.digest(s) for shard, s in secrets.items()})
    await replicas["a"].on_round_start(start, Delivery("round.start", b""))
    weights = contributions()
    for name, shard in ARRIVALS:
        result = await _stored(shared, keys.contribution(JOB, 1, 1, shard), weights[shard])
        done = WorkerDone(job_id=JOB, round=1, worker_id=f"w{shard}", shard=shard, result=result,
                          samples=SAMPLES[shard], secret=secrets[shard])
        await replicas[name].on_worker_done(done, Delivery("worker.done", b""))
    for replica in replicas.values():
        await replica.stop()
    await bus.close()
    new = loads(await shared.get_bytes(keys.global_weights(JOB, 1)))
    return new["w"].numpy().tobytes(), stores, announced


def _contribution_reads(store: CountingStorage) -> dict[int, int]:
    return {shard: store.reads.get(keys.contribution(JOB, 1, 1, shard), 0) for shard in range(len(SAMPLES))}


async def test_the_closing_replica_folds_only_what_the_other_took(database: Database, tmp_path: Path) -> None:
    new, stores, announced = await _run_round(database, tmp_path)

    # The same bits as one aggregator folding every report, in any order
    assert new == folded(list(range(len(SAMPLES))), wide=True) == folded([5, 3, 1, 0, 4, 2], wide=True)
    assert announced == [len(SAMPLES)]
    # Each replica read each contribution it took in once: b its own three, shard 0 when it first heard of
    # the round, and a's other two at the close; nothing twice
    assert _contribution_reads(stores["a"]) == {0: 1, 1: 0, 2: 1, 3: 0, 4: 1, 5: 0}
    assert _contribution_reads(stores["b"]) == dict.fromkeys(range(len(SAMPLES)), 1)


async def test_an_order_dependent_sum_is_refolded_in_the_stored_order(
        database: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A model too large for the float64 sum (here: any model) is summed in float32, where order shows
    monkeypatch.setattr(weighted_sum, "WIDE_SUM_MAX_BYTES", 0)
    stored_order, closers_own_order = list(range(len(SAMPLES))), [0, 1, 3, 5, 2, 4]
    assert folded(stored_order, wide=False) != folded(closers_own_order, wide=False)

    new, stores, announced = await _run_round(database, tmp_path)

    assert new == folded(stored_order, wide=False)
    assert announced == [len(SAMPLES)]
    # b dropped what it held and read the whole round back at the close
    assert _contribution_reads(stores["b"]) == {0: 2, 1: 2, 2: 1, 3: 2, 4: 1, 5: 2}
