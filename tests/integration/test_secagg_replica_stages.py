"""Two aggregator replicas' key agreements of one secure round, on one database (SQLite and PostgreSQL): the
protocol messages split between them, each stage is stored once and its messages sent once, by the replica whose
insert stored it; two replicas moving to the same stage at once with different sets both end up holding the
stored one, and only its messages go out."""

from __future__ import annotations

import asyncio
import time

from apiary import proof
from apiary.bus import Delivery
from apiary.bus.identity import service_user
from apiary.bus.memory import MemoryBus
from apiary.contracts import ObjectRef, RoundStart, SecAggKeys, SecAggStage, decode
from apiary.db import Database
from apiary.secagg import crypto
from apiary.secagg.protocol import Participant
from apiary.secagg.settings import SecureAggregation
from apiary.strategies.base import create
from services.aggregator.round_state import Round, RoundState
from services.aggregator.secure_rounds import SecureRounds
from services.aggregator.store import AggregatorStore, opened_row

JOB, SHARDS = "replica-stages", (0, 1, 2)
SETTINGS = SecureAggregation(num_shares=1, reconstruction_threshold=2)


class Cluster:
    """Replicas a and b of the aggregator's secure rounds, one round of three shards, what they send tapped."""

    def __init__(self, database: Database) -> None:
        self.bus = MemoryBus(service_user("aggregator"))
        self.store = AggregatorStore(database)
        self.replicas = {"a": SecureRounds(self.bus, AggregatorStore(database)),
                         "b": SecureRounds(self.bus, AggregatorStore(database))}
        self.secrets = {shard: proof.new_secret() for shard in SHARDS}
        context = crypto.round_context(JOB, 1, 1)
        signing = {shard: crypto.signing_key_from_secret(s, context) for shard, s in self.secrets.items()}
        params = SETTINGS.resolved(len(SHARDS))
        self.workers = {shard: Participant(shard + 1, context, params, key,
                                           {s + 1: crypto.verify_key(k) for s, k in signing.items()})
                        for shard, key in signing.items()}
        self.sent: list[SecAggStage] = []
        self.round: Round | None = None

    async def start(self) -> None:
        await self.bus.connect()
        await self.store.migrate("aggregator")
        start = RoundStart(job_id=JOB, round=1, num_rounds=1, shards=list(SHARDS), min_workers=2,
                           weights=ObjectRef(key="w", size=1, sha256="0" * 64), deadline=time.time() + 300,
                           secret_digests={s: proof.digest(x) for s, x in self.secrets.items()},
                           secure_aggregation=SETTINGS,
                           secagg_verify_keys=crypto.verify_keys_of(self.secrets, crypto.round_context(JOB, 1, 1)))
        row = opened_row(start)
        await self.store.open_round(row)
        self.round = Round.of(row)

        async def tap(delivery: Delivery) -> None:
            event = decode(delivery.routing_key, delivery.body)
            assert isinstance(event, SecAggStage)
            self.sent.append(event)

        await self.bus.declare_queue("tap", ["secagg.worker.#"])
        await self.bus.consume("tap", tap)

    def state(self, name: str) -> RoundState:
        assert self.round is not None
        return RoundState(round=self.round, strategy=self.replicas[name].strategy(self.round, create("fedavg", {})))

    async def keys(self, name: str, shard: int) -> None:
        ad = self.workers[shard].advertise()
        event = SecAggKeys(job_id=JOB, round=1, attempt=1, worker_id=f"w{shard}", shard=shard,
                           c_public=ad.c_public.hex(), s_public=ad.s_public.hex(), signature=ad.signature.hex(),
                           secret=self.secrets[shard])
        await self.replicas[name].on_keys(self.state(name), event, None)

    async def stages(self) -> list[str]:
        rows = await self.store.secagg_messages(JOB, 1, 1)
        return [r["kind"] for r in rows if r["shard"] == -1]

    async def settle(self) -> None:
        for _ in range(100):  # the memory bus delivers on the loop: let the tap take what was published
            await asyncio.sleep(0)


async def test_the_keys_split_between_replicas_send_one_roster(database: Database) -> None:
    cluster = Cluster(database)
    await cluster.start()

    await cluster.keys("a", 0)
    await cluster.keys("b", 1)
    await cluster.keys("a", 2)  # a has seen shards 0 and 2 itself, and reads shard 1's keys that b stored
    await cluster.settle()

    assert await cluster.stages() == ["stage.shares"]
    assert sorted((m.stage, m.shard) for m in cluster.sent) == [("roster", 0), ("roster", 1), ("roster", 2)]
    assert all([k.shard for k in m.roster] == [0, 1, 2] for m in cluster.sent)
    # b, which took only shard 1's keys, reads the stage a stored: the same roster, nothing sent again.
    held = await cluster.replicas["b"].sync(cluster.round)  # type: ignore[arg-type]
    assert held is not None and held.stage == "shares" and sorted(held.collector.roster) == [1, 2, 3]
    await cluster.replicas["b"].advance(cluster.state("b"))
    await cluster.settle()
    assert len(cluster.sent) == 3 and await cluster.stages() == ["stage.shares"]


async def test_two_replicas_moving_to_one_stage_at_once_hold_the_stored_set(database: Database) -> None:
    cluster = Cluster(database)
    await cluster.start()
    for shard in SHARDS:
        await cluster.keys("a", shard)
    round_ = cluster.round
    assert round_ is not None
    a, b = cluster.replicas["a"], cluster.replicas["b"]
    held_a, held_b = await a.sync(round_), await b.sync(round_)
    assert held_a is not None and held_b is not None
    cluster.sent.clear()

    # Each replica would fix a different survivor set (one took shard 3's masked vector, the other not yet).
    await asyncio.gather(a._move(round_, held_a, "check", {1, 2, 3}), b._move(round_, held_b, "check", {1, 2}))
    await cluster.settle()

    stored = held_a.collector.survivors
    assert stored in ({1, 2, 3}, {1, 2}) and held_b.collector.survivors == stored
    assert held_a.stage == held_b.stage == "check"
    assert sorted(m.shard for m in cluster.sent) == sorted(n - 1 for n in stored)  # one replica's messages only
    assert all(m.stage == "check" and m.survivors == sorted(n - 1 for n in stored) for m in cluster.sent)
