"""Secure aggregation with two aggregator replicas on RabbitMQ, PostgreSQL and S3 (moto): the broker hands each
protocol message and each masked contribution to either replica, and the round is still one protocol run: each
stage stored once, the final weights the plain weighted mean within the quantisation bound, a worker silent after
masking recovered from the others' shares, and the tracker's rounds say what secure aggregation did."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from apiary import keys
from apiary.secagg.settings import SecureAggregation
from apiary.settings import Settings
from apiary.weights import loads
from services.aggregator import Aggregator
from services.aggregator.store import AggregatorStore
from services.app.ports import Ports
from services.app.runtime import Embedded
from services.worker.secure_rounds import SecureShard
from tests.e2e.test_secure_aggregation import SECAGG, plain_update, request
from tests.fixtures.embedded import REPO

SIZES = {0: 5, 1: 4, 2: 4}  # the toy dataset's three shards


async def test_two_aggregator_replicas_run_one_secure_aggregation(
        tmp_path: Path, toy_dataset: Path, rabbit_url: str, bus_namespace: str, postgres_url: str, s3_url: str,
        s3_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Which replica (by its store) stored each protocol message and stage.
    stored_by: dict[int, set[str]] = defaultdict(set)
    keep = AggregatorStore.keep_secagg

    async def counted(self: AggregatorStore, key: tuple[str, int, int], shard: int, kind: str, body: str) -> bool:
        stored_by[id(self)].add(kind)
        return await keep(self, key, shard, kind, body)

    monkeypatch.setattr(AggregatorStore, "keep_secagg", counted)
    # Round 2: shard 0's worker uploads its masked vector and signs the survivor set, then never reveals a share.
    reveal = SecureShard.reveal

    async def silent_in_round_2(self: SecureShard) -> None:
        if not (self.a.shard == 0 and self.a.round == 2):
            await reveal(self)

    monkeypatch.setattr(SecureShard, "reveal", silent_in_round_2)
    settings = Settings(home=tmp_path / ".apiary", bus_url=rabbit_url, exchange=bus_namespace,
                        database_url=postgres_url, storage_url=s3_url, s3_endpoint_url=s3_server,
                        heartbeat_interval=0.5, progress_interval=0.0)
    second = Ports(settings)  # the second replica's own connections to the broker, database and bucket
    async with Embedded(settings, workers=3, code_paths=[str(REPO)]) as stack:
        await second.open()
        replica = Aggregator(second.bus, second.db, second.storage, stack.settings)
        await replica.start()
        try:
            job_id = await stack.submit(request(toy_dataset, num_rounds=2))
            view = await stack.wait(job_id, timeout=240)
            db = stack.ports.db
            stages = await db.fetch("SELECT round, kind FROM secagg_messages WHERE job_id = $1 AND shard = -1"
                                    " ORDER BY round, received_at", job_id)
            revealed = await db.fetch("SELECT round, shard FROM secagg_messages WHERE job_id = $1 AND kind = 'reveal'"
                                      " ORDER BY round, shard", job_id)
            accepted = await db.fetch("SELECT round, shard FROM contributions WHERE job_id = $1 AND status = 'accepted'"
                                      " ORDER BY round, shard", job_id)
            first = loads(await stack.ports.storage.get_bytes(keys.global_weights(job_id, 1)))
            final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))
            stores = {"embedded": id(stack.aggregator.store), "replica": id(replica.store)}
        finally:
            await replica.stop()
            await second.close()

    assert view["status"] == "completed", view.get("reason")
    # Each replica stored some of the workers' protocol messages: the broker split them between the two.
    protocol = {"keys", "shares", "check", "reveal"}
    assert all(stored_by[store] & protocol for store in stores.values()), dict(stored_by)
    # Every stage stored once a round, in order, however the messages were split.
    order = ["stage.shares", "stage.masked", "stage.check", "stage.unmask"]
    assert [(r["round"], r["kind"]) for r in stages] == [(n, kind) for n in (1, 2) for kind in order]
    assert [(r["round"], r["shard"]) for r in accepted] == [(n, s) for n in (1, 2) for s in range(3)]
    # Round 1 closes once two of its three survivors' shares are in (a third, later, finds it closed); round 2's
    # silent shard 0 has its self mask rebuilt from shards 1 and 2's shares.
    assert len([r for r in revealed if r["round"] == 1]) >= 2
    assert [r["shard"] for r in revealed if r["round"] == 2] == [1, 2]
    bound = SecureAggregation(**SECAGG).resolved(3).error_bound(3, 13)
    for name in ("layer.weight", "layer.bias", "wide.weight"):
        expected = first[name].double() + sum(
            SIZES[s] * torch.from_numpy(plain_update(2, s, first)[name]) for s in range(3)) / 13
        assert (final[name].double() - expected).abs().max().item() <= bound + 1e-6
    summaries: list[dict[str, Any]] = [r["secure_aggregation"] for r in view["rounds"]]
    assert [s["stage"] for s in summaries] == ["unmasked", "unmasked"]
    assert summaries[1]["survivors"] == [0, 1, 2] and summaries[1]["revealed"] == [1, 2]
    assert summaries[1]["threshold"] == 2 and summaries[1]["participants"] == [0, 1, 2]
