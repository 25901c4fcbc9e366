"""A job's strategy in its request: defaults, env PROXIMAL_MU, one line per bad field, the scheduler's round.start."""

from __future__ import annotations

from typing import Any

from apiary.contracts import ObjectRef, ShardInfo
from apiary.jobspec import JobSpec, strategy_errors
from services.scheduler.round_plan import RoundTarget, plan_round, round_start

BASE: dict[str, Any] = {"name": "job", "entrypoint": "pkg.train", "dataset": "data",
                        "distributed": {"min_workers": 2, "max_workers": 3}}


def _spec(**distributed: Any) -> JobSpec:
    return JobSpec.model_validate({**BASE, "distributed": {**BASE["distributed"], **distributed}})


def test_a_job_without_a_strategy_uses_federated_averaging_and_is_valid() -> None:
    spec = _spec()

    assert (spec.distributed.strategy, spec.distributed.strategy_params) == ("federated_averaging", {})
    assert strategy_errors(spec) == []
    assert "PROXIMAL_MU" not in spec.env(1)


def test_an_unknown_strategy_is_named_with_the_known_ones() -> None:
    errors = strategy_errors(_spec(strategy="fedmagic"))

    assert [e.field for e in errors] == ["distributed.strategy"]
    assert "unknown strategy 'fedmagic'" in errors[0].message and "federated_averaging" in errors[0].message


def test_an_unknown_strategy_parameter_is_named_with_the_strategy_s_own() -> None:
    errors = strategy_errors(_spec(strategy="fedavg", strategy_params={"server_momentum": 0.9}))

    assert [e.field for e in errors] == ["distributed.strategy_params"]
    assert "server_momentum" in errors[0].message and "its parameters" in errors[0].message


def test_fedprox_gives_the_training_loop_its_mu() -> None:
    spec = _spec(strategy="fedprox", strategy_params={"proximal_mu": 0.25})

    assert spec.env(1)["PROXIMAL_MU"] == 0.25


def test_round_start_carries_the_job_s_strategy_and_parameters() -> None:
    spec = _spec(strategy="fedavg", strategy_params={})
    shards = [ShardInfo(key=f"s{i}", size=1, sha256="x", index=i, num_samples=4) for i in range(3)]
    target = RoundTarget("job-1", spec, shards, ObjectRef(key="w", size=1, sha256="y"), 1, 1)

    event = round_start(target, plan_round(spec, shards, now=100.0))

    assert (event.strategy, event.strategy_params) == ("fedavg", {})
