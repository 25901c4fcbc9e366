"""The aggregator with differential privacy (SQLite and PostgreSQL): a round.start that asks for it stores it with
the round, clips updates on arrival (clip_on server) or refuses one over the norm as rejected (clip_on worker), and
stores the wrapper's state (clipping norm, releases) with the round's result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from apiary import keys, proof
from apiary.bus import Delivery
from apiary.bus.identity import service_user
from apiary.bus.memory import MemoryBus
from apiary.contracts import RoundAggregated, WorkerDone
from apiary.db import Database
from apiary.privacy import DifferentialPrivacy
from apiary.storage.local import LocalStorage
from apiary.strategies.clipping import clipped, update_norm
from apiary.weights import loads
from services.aggregator import Aggregator
from tests.fixtures.aggregator_round import first_round, store_weights
from tests.fixtures.services import tap_aggregated

JOB = "private"
START = {"w": torch.zeros(4)}
# Shard s's update is s + 1 along one axis each: norms 1, 2, 3.
UPDATES = {0: torch.tensor([1.0, 0, 0, 0]), 1: torch.tensor([0, 2.0, 0, 0]), 2: torch.tensor([0, 0, 3.0, 0])}


class PrivateRound:
    """One aggregator on a memory bus, a database and a folder, with round 1 of a three-shard private job started."""

    def __init__(self, database: Database, tmp_path: Path) -> None:
        self.bus = MemoryBus(service_user("aggregator"))
        self.storage = LocalStorage(tmp_path / "store")
        self.aggregator = Aggregator(self.bus, database, self.storage)
        self.database = database
        self.secrets = {shard: proof.new_secret() for shard in UPDATES}
        self.announced: list[RoundAggregated] = []

    async def start(self, privacy: dict[str, Any]) -> None:
        await self.bus.connect()
        await self.aggregator.start()
        self.announced = await tap_aggregated(self.bus)
        settings = DifferentialPrivacy.model_validate(privacy).resolved(len(UPDATES))
        start = await first_round(self.storage, JOB, self.secrets, START, num_rounds=2, min_workers=2,
                                  differential_privacy=settings)
        await self.aggregator.on_round_start(start, Delivery("round.start", b""))


    async def report(self, shard: int, weights: dict[str, torch.Tensor]) -> None:
        result = await store_weights(self.storage, keys.contribution(JOB, 1, 1, shard), weights)
        done = WorkerDone(job_id=JOB, round=1, worker_id=f"w{shard}", shard=shard, result=result, samples=10,
                          secret=self.secrets[shard])
        await self.aggregator.on_worker_done(done, Delivery("worker.done", b""))

    async def stop(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Stop; the round's stored result and strategy state."""
        await self.aggregator.stop()
        await self.bus.close()
        return (loads(await self.storage.get_bytes(keys.global_weights(JOB, 1))),
                loads(await self.storage.get_bytes(keys.strategy_state(JOB, 1))))

    async def statuses(self) -> dict[int, tuple[str, str | None]]:
        rows = await self.database.fetch("SELECT shard, status, reason FROM contributions WHERE job_id = $1", JOB)
        return {row["shard"]: (row["status"], row["reason"]) for row in rows}


@pytest.fixture
def private_round(database: Database, tmp_path: Path) -> PrivateRound:
    return PrivateRound(database, tmp_path)


async def test_the_server_clips_each_update_and_stores_its_state(private_round: PrivateRound,
                                                                  database: Database) -> None:
    await private_round.start({"noise_multiplier": 0.0, "clipping_norm": 1.5})

    for shard, update in UPDATES.items():
        await private_round.report(shard, {"w": START["w"] + update})
    result, state = await private_round.stop()

    expected = sum(clipped({"w": START["w"] + u}, START, 1.5)["w"] for u in UPDATES.values()) / 3
    assert torch.allclose(result["w"], expected, rtol=0, atol=1e-7)
    assert float(state["dp.clipping_norm"]) == 1.5 and int(state["dp.releases"]) == 1
    [event] = private_round.announced
    assert event.contributors == [0, 1, 2] and event.metrics["dp_clipping_norm"] == 1.5
    stored = await database.fetchval("SELECT privacy FROM aggregations WHERE job_id = $1", JOB)
    assert DifferentialPrivacy.model_validate_json(stored).clipping_norm == 1.5


async def test_an_update_over_the_norm_is_rejected_when_workers_clip(private_round: PrivateRound) -> None:
    await private_round.start({"noise_multiplier": 0.0, "clipping_norm": 2.0, "clip_on": "worker"})

    for shard, update in UPDATES.items():  # shard 2's update (norm 3) was not clipped by its worker
        await private_round.report(shard, {"w": START["w"] + update})
    result, _ = await private_round.stop()

    statuses = await private_round.statuses()
    assert statuses[0] == ("accepted", None) and statuses[1] == ("accepted", None)
    assert statuses[2][0] == "rejected" and "update norm 3 is over the clipping norm 2" in str(statuses[2][1])
    assert torch.allclose(result["w"], (UPDATES[0] + UPDATES[1]) / 2, rtol=0, atol=1e-7)
    assert update_norm(result, START) <= 2.0
    [event] = private_round.announced
    assert event.contributors == [0, 1] and "2" in event.rejected
