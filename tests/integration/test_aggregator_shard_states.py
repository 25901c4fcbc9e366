"""The aggregator's checks of a reported shard state (on SQLite and PostgreSQL, local storage): the object its
assignment's URL wrote, within the bound, of the same names and shapes as the shard's state from its last
aggregated round; only the states of accepted shards in an aggregated round are the shard's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apiary import keys
from apiary.contracts import ObjectRef, RoundStart, WorkerDone
from apiary.db import Database
from apiary.status import ContributionStatus, RoundStatus
from apiary.storage import Storage
from apiary.storage.local import LocalStorage
from apiary.strategies.validation import InvalidContribution
from apiary.weights import dumps
from services.aggregator import shard_states
from services.aggregator.store import AggregatorStore, opened_row

WEIGHTS = ObjectRef(key="jobs/j/rounds/0000/global.safetensors", size=1000, sha256="a" * 64)


async def _round(store: AggregatorStore, round_index: int) -> None:
    await store.open_round(opened_row(RoundStart(job_id="j", round=round_index, attempt=1, num_rounds=3,
                                                 shards=[0, 1], min_workers=1, weights=WEIGHTS, deadline=1e12)))


async def _report(storage: Storage, round_index: int, shard: int, state: dict[str, torch.Tensor],
                  key: str | None = None) -> WorkerDone:
    ref = await storage.put_bytes(key or keys.shard_state("j", shard, round_index, 1), dumps(state))
    return WorkerDone(job_id="j", round=round_index, attempt=1, shard=shard, worker_id="w", samples=3, state=ref,
                      result=ObjectRef(key=keys.contribution("j", round_index, 1, shard), size=1, sha256="b" * 64))


async def test_a_state_must_keep_the_shape_of_its_shards_last_accepted_one(database: Database,
                                                                          tmp_path: Path) -> None:
    # Prepare: round 1 aggregated with shard 0's state accepted; shard 1's state stored but its report refused
    storage = LocalStorage(tmp_path / "store")
    store = AggregatorStore(database)
    await store.migrate("aggregator")
    await database.migrate(shard_states.COMPONENT, shard_states.MIGRATIONS)
    await _round(store, 1)
    first = await _report(storage, 1, 0, {"c": torch.zeros(3)})
    refused = await _report(storage, 1, 1, {"c": torch.zeros(5)})
    for report, status in ((first, ContributionStatus.ACCEPTED), (refused, ContributionStatus.REJECTED)):
        await shard_states.remember(storage, database, report,
                                    await shard_states.check(storage, database, report, WEIGHTS.size))
        await store.record(report, status, None)
    async with database.transaction() as tx:
        assert await store.close(tx, ("j", 1, 1), RoundStatus.AGGREGATED, result_key="r")
        announced = await shard_states.of_round(tx, ("j", 1, 1), [0])
    await _round(store, 2)

    # Execute / Assert: round 2 holds shard 0 to its shape; shard 1 had no accepted state, so any shape goes
    assert first.state is not None
    kept = first.state.model_copy(update={"key": keys.kept_shard_state("j", 0, first.state.sha256)})
    assert announced == {0: kept}
    # A second upload to the assignment's key (it trained twice) leaves the kept state as it was judged.
    await storage.put_bytes(first.state.key, dumps({"c": torch.ones(7)}))
    assert (await storage.verified_bytes(kept)) == dumps({"c": torch.zeros(3)})
    await shard_states.check(storage, database, await _report(storage, 2, 0, {"c": torch.ones(3)}), WEIGHTS.size)
    await shard_states.check(storage, database, await _report(storage, 2, 1, {"d": torch.ones(2)}), WEIGHTS.size)
    with pytest.raises(InvalidContribution, match=r"^shard state tensor 'c' is float32\[4\], last round's was "
                                                  r"float32\[3\]$"):
        await shard_states.check(storage, database, await _report(storage, 2, 0, {"c": torch.ones(4)}), WEIGHTS.size)
    with pytest.raises(InvalidContribution, match=r"names differ from last round's: missing \['c'\], extra \['e'\]"):
        await shard_states.check(storage, database, await _report(storage, 2, 0, {"e": torch.ones(3)}), WEIGHTS.size)
    with pytest.raises(InvalidContribution, match=r"over the bound of 1048576"):
        await shard_states.check(storage, database, await _report(storage, 2, 1, {"d": torch.ones(300_000)}), 0)
    with pytest.raises(InvalidContribution, match=r"is not this assignment's upload"):
        await shard_states.check(storage, database, await _report(storage, 2, 0, {"c": torch.ones(3)},
                                                                  key="jobs/j/elsewhere.safetensors"), WEIGHTS.size)
