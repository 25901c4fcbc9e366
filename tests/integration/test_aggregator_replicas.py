"""Two aggregator replicas share a round's reports (SQLite and PostgreSQL): the one whose report settles the
last shard closes the round, folding in only the contributions the other replica took (each read once), with
the bits one aggregator folding every report gives. Two replicas closing the same round at once (a timeout
racing the last report) write one result: the one the round's row and its round.aggregated name. A report that
reaches one replica before the round's round.start is handled by the other waits for it: it is no orphan. A report
taken by both replicas at once is counted once."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from apiary import keys, proof
from apiary.bus import Delivery
from apiary.bus.identity import service_user
from apiary.bus.memory import MemoryBus
from apiary.contracts import ObjectRef, RoundAggregated, RoundStart, RoundTimeout, WorkerDone
from apiary.db import Database
from apiary.storage.local import LocalStorage
from apiary.strategies.weighted_sum import WeightedSum
from apiary.weights import dumps, loads
from services.aggregator import Aggregator, open_rounds
from tests.fixtures.services import tap_aggregated

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
        self.reading = self.most_at_once = 0

    async def get_bytes(self, key: str) -> bytes:
        self.reads[key] = self.reads.get(key, 0) + 1
        self.reading += 1
        self.most_at_once = max(self.most_at_once, self.reading)
        try:
            await asyncio.sleep(0.01)
            return await super().get_bytes(key)
        finally:
            self.reading -= 1


def contributions() -> list[dict[str, torch.Tensor]]:
    """Six workers' weights, with values far apart in magnitude."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(64, generator=gen)
    out = []
    for i in range(len(SAMPLES)):
        w = base + torch.randn(64, generator=gen) * 0.01
        w[:6] = torch.tensor([1e4, -1e4, 1e-6, -1e-6, 3.0, -0.1]) * (i + 1)
        out.append({"w": w})
    return out


def folded(order: list[int]) -> bytes:
    total = WeightedSum()
    for i in order:
        total.fold(contributions()[i], SAMPLES[i])
    return total.finish()["w"].numpy().tobytes()


async def _stored(storage: LocalStorage, key: str, weights: dict[str, torch.Tensor]) -> ObjectRef:
    data = dumps(weights)
    await storage.put_bytes(key, data)
    return ObjectRef(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())


class SlowStorage(CountingStorage):
    """A replica's store whose writes take their time (a large model, a far bucket)."""

    async def put_bytes(self, key: str, data: bytes) -> ObjectRef:
        await asyncio.sleep(0.3)
        return await super().put_bytes(key, data)


class Replicas:
    """Aggregator replicas a and b on one bus, database and folder, with round 1 of a six-shard job started
    (round.start reached a) and what they announce tapped."""

    def __init__(self, database: Database, tmp_path: Path, slow_b: bool = False) -> None:
        self.bus = MemoryBus(service_user("aggregator"))
        self.shared = LocalStorage(tmp_path / "store")
        self.stores = {"a": CountingStorage(tmp_path / "store"),
                       "b": (SlowStorage if slow_b else CountingStorage)(tmp_path / "store")}
        self.replicas = {name: Aggregator(self.bus, database, store) for name, store in self.stores.items()}
        self.announced: list[RoundAggregated] = []
        self.secrets = {shard: proof.new_secret() for shard in range(len(SAMPLES))}

    async def start(self, min_workers: int, *, announce: bool = True) -> None:
        """Start both replicas and, if `announce`, hand round 1's round.start to a (else `announce_round` does)."""
        await self.bus.connect()
        for replica in self.replicas.values():
            await replica.start()
        self.announced = await tap_aggregated(self.bus)
        self.min_workers = min_workers
        if announce:
            await self.announce_round()

    async def announce_round(self) -> None:
        """Round 1's round.start, handled by replica a."""
        start = RoundStart(job_id=JOB, round=1, num_rounds=1, shards=list(self.secrets), min_workers=self.min_workers,
                           weights=await _stored(self.shared, keys.global_weights(JOB, 0), {"w": torch.zeros(64)}),
                           deadline=time.time() + 300,
                           secret_digests={shard: proof.digest(s) for shard, s in self.secrets.items()})
        await self.replicas["a"].on_round_start(start, Delivery("round.start", b""))

    async def report(self, name: str, shard: int) -> None:
        result = await _stored(self.shared, keys.contribution(JOB, 1, 1, shard), contributions()[shard])
        done = WorkerDone(job_id=JOB, round=1, worker_id=f"w{shard}", shard=shard, result=result,
                          samples=SAMPLES[shard], secret=self.secrets[shard])
        await self.replicas[name].on_worker_done(done, Delivery("worker.done", b""))

    async def stop(self) -> bytes:
        """Stop both; the bytes of the round's stored result."""
        for replica in self.replicas.values():
            await replica.stop()
        await self.bus.close()
        return await self.shared.get_bytes(keys.global_weights(JOB, 1))


def _contribution_reads(store: CountingStorage) -> dict[int, int]:
    return {shard: store.reads.get(keys.contribution(JOB, 1, 1, shard), 0) for shard in range(len(SAMPLES))}


async def test_the_closing_replica_folds_only_what_the_other_took(database: Database, tmp_path: Path) -> None:
    cluster = Replicas(database, tmp_path)
    await cluster.start(min_workers=len(SAMPLES))
    for name, shard in ARRIVALS:
        await cluster.report(name, shard)
    new = loads(await cluster.stop())["w"].numpy().tobytes()

    # The same bits as one aggregator folding every report, in any order
    assert new == folded(list(range(len(SAMPLES)))) == folded([5, 3, 1, 0, 4, 2])
    assert [len(event.contributors) for event in cluster.announced] == [len(SAMPLES)]
    # Each replica read each contribution it took in once: b its own three, shard 0 when it first heard of
    # the round, and a's other two at the close; nothing twice
    assert _contribution_reads(cluster.stores["a"]) == {0: 1, 1: 0, 2: 1, 3: 0, 4: 1, 5: 0}
    assert _contribution_reads(cluster.stores["b"]) == dict.fromkeys(range(len(SAMPLES)), 1)


async def test_a_timeout_racing_the_last_report_stores_the_result_it_announces(
        database: Database, tmp_path: Path) -> None:
    # b writes slowly: were both closers to write, b's result would land after a's was committed
    cluster = Replicas(database, tmp_path, slow_b=True)
    await cluster.start(min_workers=len(SAMPLES) - 1)
    for name, shard in ARRIVALS[:-1]:
        await cluster.report(name, shard)

    # a's timeout closes with five shards while b's last report closes with six
    timeout = RoundTimeout(job_id=JOB, round=1)
    await asyncio.gather(cluster.replicas["a"].on_round_timeout(timeout, Delivery("round.timeout", b"")),
                         cluster.report(*ARRIVALS[-1]))
    stored = await cluster.stop()

    [event] = cluster.announced
    assert event.weights.sha256 == hashlib.sha256(stored).hexdigest()
    assert loads(stored)["w"].numpy().tobytes() == folded(event.contributors)
    row = await database.fetchrow("SELECT status, result_key FROM aggregations WHERE job_id = $1", JOB)
    assert row == {"status": "aggregated", "result_key": keys.global_weights(JOB, 1)}


async def test_contributions_over_the_prefetch_limit_are_folded_one_at_a_time(
        database: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every contribution counts as large here: the closing replica holds one at a time besides its sum
    monkeypatch.setattr(open_rounds, "PREFETCH_MAX_BYTES", 100)
    cluster = Replicas(database, tmp_path)
    await cluster.start(min_workers=len(SAMPLES))
    for name, shard in ARRIVALS:
        await cluster.report(name, shard)
    new = loads(await cluster.stop())["w"].numpy().tobytes()

    assert new == folded(list(range(len(SAMPLES))))
    assert cluster.stores["b"].most_at_once == 1


async def test_a_report_overtaking_its_round_start_on_another_replica_still_counts(
        database: Database, tmp_path: Path) -> None:
    # Prepare: b takes shard 1's report while a has not handled round.start yet (it waited for the job's lock)
    cluster = Replicas(database, tmp_path)
    await cluster.start(min_workers=len(SAMPLES), announce=False)
    early = asyncio.create_task(cluster.report("b", 1))
    await asyncio.sleep(0.3)
    assert not early.done()

    # Execute: round.start reaches a, then the other reports arrive
    await cluster.announce_round()
    await asyncio.wait_for(early, 10)
    for name, shard in ARRIVALS:
        if shard != 1:
            await cluster.report(name, shard)
    new = loads(await cluster.stop())["w"].numpy().tobytes()

    # Assert: shard 1 counted, once; the round closed with every shard
    assert new == folded(list(range(len(SAMPLES))))
    [event] = cluster.announced
    assert event.contributors == list(range(len(SAMPLES)))
    statuses = await database.fetch("SELECT shard, status FROM contributions WHERE job_id = $1 ORDER BY shard", JOB)
    assert [(r["shard"], r["status"]) for r in statuses] == [(shard, "accepted") for shard in range(len(SAMPLES))]


async def test_a_report_taken_by_both_replicas_at_once_counts_once(database: Database, tmp_path: Path) -> None:
    # Prepare: commits take a while, so both replicas take shard 0's report (delivered twice) in before either stores it
    cluster = Replicas(database, tmp_path)
    for replica in cluster.replicas.values():
        record = replica.store.record_settling

        async def slow(key: tuple[str, int, int], rows: Any, record: Any = record) -> int | None:
            await asyncio.sleep(0.1)
            return await record(key, rows)

        replica.store.record_settling = slow  # type: ignore[method-assign]
    await cluster.start(min_workers=len(SAMPLES))

    # Execute: both handle it at once (neither fails), then the other shards come
    await asyncio.wait_for(asyncio.gather(cluster.report("a", 0), cluster.report("b", 0)), 10)
    for name, shard in ARRIVALS[1:]:
        await cluster.report(name, shard)
    new = loads(await cluster.stop())["w"].numpy().tobytes()

    # Assert: shard 0 accepted once, its second report kept as a duplicate, the round's bits those of one aggregator
    rows = await database.fetch("SELECT status FROM contributions WHERE job_id = $1 AND shard = 0 ORDER BY seq", JOB)
    assert sorted(r["status"] for r in rows) == ["accepted", "duplicate"]
    assert new == folded(list(range(len(SAMPLES))))
    [event] = cluster.announced
    assert event.contributors == list(range(len(SAMPLES)))
    settled = await database.fetchval("SELECT settled FROM aggregations WHERE job_id = $1", JOB)
    assert settled == len(SAMPLES)
