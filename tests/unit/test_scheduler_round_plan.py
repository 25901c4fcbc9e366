"""How a round starts: waiting for workers, where each shard goes, the deadline, the messages' fields."""

from __future__ import annotations

from typing import Any

from apiary.contracts import ObjectRef, ShardInfo
from apiary.jobspec import JobSpec
from services.scheduler.round_plan import (
    AssignmentUrls,
    Queue,
    RoundTarget,
    Route,
    assignment,
    online_preferences,
    plan_round,
    round_start,
    route,
    url_lifetime,
    waiting_for_workers,
)

WEIGHTS = ObjectRef(key="jobs/j1/rounds/0001/global.safetensors", size=10, sha256="w" * 64)
URLS = AssignmentUrls(shard="s-url", weights="w-url", upload="u-url", files_upload="f-url", ended="e-url")


def _spec(**overrides: Any) -> JobSpec:
    fields: dict[str, Any] = {"name": "toy", "entrypoint": "pkg.mod:fl_train_model", "dataset": "/data",
                              "config": {"epochs": 2},
                              "distributed": {"num_rounds": 3, "min_workers": 2, "max_workers": 3,
                                              "aggregation_timeout": 60}}
    fields.update(overrides)
    return JobSpec.model_validate(fields)


def _shards(count: int) -> list[ShardInfo]:
    return [ShardInfo(index=i, key=f"jobs/j1/shards/shard-{i:04d}.zip", size=5, sha256=f"{i}" * 64,
                      num_samples=100 + i) for i in range(count)]


def test_a_round_waits_until_min_workers_are_online() -> None:
    waiting = waiting_for_workers(2, [], {"w1"})

    assert waiting is not None
    assert (waiting.online, waiting.required) == (1, 2)
    assert waiting.reason == "waiting for workers: 1 online, min_workers is 2"
    assert waiting_for_workers(2, [], {"w1", "w2"}) is None


def test_a_pinned_job_counts_only_its_own_workers() -> None:
    waiting = waiting_for_workers(2, ["a", "b"], {"a", "x", "y"})

    assert waiting is not None
    assert waiting.online == 1
    assert waiting.reason == "waiting for workers: 1 of its pinned workers ['a', 'b'] online, min_workers is 2"
    assert waiting_for_workers(2, ["a", "b"], {"a", "b"}) is None


def test_only_online_workers_are_preferred() -> None:
    assert online_preferences({0: "w1", 1: "gone"}, {"w1", "w2"}) == {0: "w1"}
    assert online_preferences(None, {"w1"}) == {}


def test_pinned_shards_go_to_their_worker_preferred_to_last_rounds_worker_others_to_the_pool() -> None:
    assert route(1, ["a", "b"], {1: "w9"}) == Route(Queue.PINNED, "b")
    assert route(0, [], {0: "w1"}) == Route(Queue.PREFERRED, "w1")
    assert route(2, [], {0: "w1"}) == Route(Queue.POOL)


def test_a_round_trains_at_most_max_workers_shards_until_its_deadline() -> None:
    plan = plan_round(_spec(), _shards(5), now=1000.0)

    assert [s.index for s in plan.chosen] == [0, 1, 2]
    assert (plan.started_at, plan.timeout, plan.deadline) == (1000.0, 60, 1060.0)
    assert url_lifetime(plan, 3600) == 3660


def test_round_start_names_the_round_its_shards_and_weights() -> None:
    spec = _spec()
    target = RoundTarget("j1", spec, _shards(3), WEIGHTS, round=2, attempt=1)
    plan = plan_round(spec, target.shards, now=1000.0)

    event = round_start(target, plan)

    assert (event.job_id, event.round, event.attempt, event.num_rounds) == ("j1", 2, 1, 3)
    assert (event.shards, event.min_workers, event.deadline) == ([0, 1, 2], 2, 1060.0)
    assert event.weights == WEIGHTS


def test_an_assignment_carries_its_shard_urls_keys_and_env() -> None:
    spec = _spec(worker_selection={"mode": "pinned", "workers": ["a", "b", "c"]})
    target = RoundTarget("j1", spec, _shards(3), WEIGHTS, round=2, attempt=3)
    plan = plan_round(spec, target.shards, now=1000.0)

    message = assignment(target, plan, target.shards[1], URLS)

    assert (message.shard, message.num_shards, message.shard_num_samples) == (1, 3, 101)
    assert (message.shard_url, message.weights_url, message.upload_url) == ("s-url", "w-url", "u-url")
    assert (message.files_upload_url, message.ended_url) == ("f-url", "e-url")
    assert message.result_key == "jobs/j1/rounds/0002/attempt-3/shard-0001.safetensors"
    assert (message.pinned_worker, message.issued_at, message.deadline) == ("b", 1000.0, 1060.0)
    assert message.env["EPOCHS"] == 2 and message.env["ROUND"] == 2
