"""Per-shard state end to end on the embedded stack (issue 41): a shard's state follows the shard from round to
round whichever worker trains it, a failed shard keeps its previous state, a state of another shape fails the
shard in one line, personal layers stay with their shard and land beside the final model."""

from __future__ import annotations

from pathlib import Path

import torch

from apiary import keys
from apiary.weights import loads
from tests.fixtures.embedded import StackFactory, toy_request


def stateful_request(dataset: Path, **distributed: object) -> dict[str, object]:
    return {**toy_request(dataset, **distributed), "entrypoint": "tests.toyjobs.stateful:fl_train_model"}


async def test_state_follows_its_shard_and_a_failed_shard_keeps_its_previous_state(embedded: StackFactory,
                                                                                   toy_dataset: Path) -> None:
    request = stateful_request(toy_dataset, num_rounds=3, min_workers=1, max_workers=3, fault_tolerance=0)
    request["config"] = {"fail": {"2": [1]}, "bad_state": {"2": [2]}}
    async with embedded(workers=2) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        rows = await stack.ports.db.fetch(
            "SELECT round, shard, status, reason, metrics FROM contributions WHERE job_id = $1 ORDER BY round, shard",
            job_id)
        finals = {s: loads(await stack.ports.storage.get_bytes(keys.final_shard_state(job_id, s))) for s in range(3)}

    assert view["status"] == "completed", view.get("reason")
    by = {(r["round"], r["shard"]): r for r in rows}
    # Round 2: shard 1 raised, shard 2 returned a state of another shape: both failed, in one line each.
    assert by[(2, 1)]["status"] == "failed" and "toy failure" in by[(2, 1)]["reason"]
    assert by[(2, 2)]["status"] == "failed"
    assert "shard state tensor 'visits' is int64[2], last round's was int64[1]" in by[(2, 2)]["reason"]
    assert "\n" not in by[(2, 2)]["reason"]
    # Each shard's final state counts the rounds it was accepted in (the failed ones kept their round-1 state)...
    assert {s: int(state["visits"][0]) for s, state in finals.items()} == {0: 3, 1: 2, 2: 2}
    # ...and only ever held its own shard's (the toy raises if it is handed another's).
    assert {s: int(state["shard"]) for s, state in finals.items()} == {0: 0, 1: 1, 2: 2}
    # The job's view (apiary status, the API, the dashboard) says what each shard keeps.
    kept = view["shard_state"]
    assert len(kept["bytes_per_shard"]) == 3 and kept["server_state_bytes"] is None
    assert kept["total_bytes"] == sum(kept["bytes_per_shard"].values()) > 0


async def test_personal_layers_stay_with_their_shard(embedded: StackFactory, toy_dataset: Path) -> None:
    request = stateful_request(toy_dataset, num_rounds=2, min_workers=3, max_workers=3,
                               personal_layers=["layer.bias"])
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))
        finals = {s: loads(await stack.ports.storage.get_bytes(keys.final_shard_state(job_id, s))) for s in range(3)}

    assert view["status"] == "completed", view.get("reason")
    # The shared tensor is averaged (each shard added s + 1, unweighted by the equal sample counts: +2 a round)...
    torch.testing.assert_close(final["layer.weight"], torch.full((2, 3), 4.0))
    # ...the personal one never left its shard: the global model keeps its initial value, each shard its own.
    torch.testing.assert_close(final["layer.bias"], torch.arange(2, dtype=torch.float32))
    for shard, state in finals.items():
        torch.testing.assert_close(state["personal.layer.bias"], torch.arange(2, dtype=torch.float32) + 2 * (shard + 1))


async def test_personal_layers_that_match_nothing_are_refused_before_the_job_starts(embedded: StackFactory,
                                                                                    toy_dataset: Path) -> None:
    request = stateful_request(toy_dataset, num_rounds=2, min_workers=1, max_workers=2, personal_layers=["head.*"])
    async with embedded(workers=1) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        rounds = await stack.ports.db.fetch("SELECT round FROM rounds WHERE job_id = $1 AND round > 0", job_id)

    assert view["status"] == "failed"
    assert "personal_layers ['head.*'] match no tensor of the model" in view["reason"]
    assert rounds == []


async def test_only_the_states_a_round_may_still_need_stay_in_storage(embedded: StackFactory,
                                                                      toy_dataset: Path) -> None:
    request = stateful_request(toy_dataset, num_rounds=4, min_workers=1, max_workers=3, fault_tolerance=0)
    request["config"] = {"fail": {"2": [1]}, "bad_state": {"3": [2]}}
    async with embedded(workers=2) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        stored = await stack.ports.storage.list(f"{keys.job_prefix(job_id)}shard-state/")
        current = await stack.ports.db.fetch("SELECT shard, state_key FROM shard_states WHERE job_id = $1", job_id)
        finals = {s: loads(await stack.ports.storage.get_bytes(keys.final_shard_state(job_id, s))) for s in range(3)}

    assert view["status"] == "completed", view.get("reason")
    # Four rounds wrote twelve uploads and ten kept copies; what stays is each shard's current state, no more...
    assert sorted(stored) == sorted(r["state_key"] for r in current)
    assert len(stored) == 3
    # ...while the shards that failed (round 2) or were refused (round 3) still found their previous state.
    assert {s: int(state["visits"][0]) for s, state in finals.items()} == {0: 4, 1: 3, 2: 3}


async def test_the_final_model_keeps_the_shard_states_of_its_round(embedded: StackFactory, toy_dataset: Path) -> None:
    # visits_before grows each round (0, 1, 2): with mode min the best round is round 1, kept over round 3's.
    request = stateful_request(toy_dataset, num_rounds=3, min_workers=3, max_workers=3, personal_layers=["layer.bias"],
                               early_stopping={"metric": "visits_before", "mode": "min", "patience": 5,
                                               "keep_best": True})
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))
        finals = {s: loads(await stack.ports.storage.get_bytes(keys.final_shard_state(job_id, s))) for s in range(3)}
        stored = await stack.ports.storage.list(f"{keys.job_prefix(job_id)}shard-state/")

    assert view["status"] == "completed", view.get("reason")
    # The final model is round 1's (the shared tensor moved once, by +2)...
    torch.testing.assert_close(final["layer.weight"], torch.full((2, 3), 2.0))
    # ...and so is each shard's state beside it: one visit, its personal layer moved once.
    assert {s: int(state["visits"][0]) for s, state in finals.items()} == {0: 1, 1: 1, 2: 1}
    for shard, state in finals.items():
        torch.testing.assert_close(state["personal.layer.bias"], torch.arange(2, dtype=torch.float32) + shard + 1)
    # While it could still be kept, round 1's states were not pruned: they stay beside round 3's (the current ones).
    assert len(stored) == 6


async def test_a_scaffold_worker_uploads_its_weights_and_its_state_only(embedded: StackFactory,
                                                                         toy_dataset: Path) -> None:
    request = {**toy_request(toy_dataset, num_rounds=2, min_workers=3, max_workers=3, strategy="scaffold",
                             transfer={"keep_contributions": True}),
               "entrypoint": "tests.toyjobs.scaffoldtoy:fl_train_model"}
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        storage = stack.ports.storage
        model = await storage.get_bytes(keys.global_weights(job_id, 1))
        uploads = [(await storage.get_bytes(keys.contribution(job_id, 2, 1, s)),
                    await storage.get_bytes(keys.shard_state(job_id, s, 2, 1))) for s in range(3)]
        c = loads(await storage.get_bytes(keys.strategy_state(job_id, 2)))

    assert view["status"] == "completed", view.get("reason")
    for weights, state in uploads:
        # The weights as the model has them (no control deltas: the aggregator derives those from the states)...
        assert set(loads(weights)) == set(loads(model)) and len(weights) == len(model)
        # ...and the shard's new control variate: two models up a round in all, at most.
        assert set(loads(state)) == {"scaffold.c_i.layer.weight", "scaffold.c_i.layer.bias"}
        assert len(weights) + len(state) <= 2 * len(model)
    # The control variate c the aggregator folded from the derived deltas moved.
    assert any(bool(t.abs().max() > 0) for t in c.values())
