"""The job request: defaults, env, and one clear error per bad field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from apiary.contracts import JobRequested
from apiary.jobspec import JobSpec, describe_errors, field_errors

GOOD = {
    "name": "digits-fedavg",
    "entrypoint": "examples.digits.train:fl_train_model",
    "dataset": "examples/digits/data",
    "config": {"epochs": 1, "batch_size": 32, "learning_rate": 0.01},
    "distributed": {"num_rounds": 5, "steps_per_round": None, "min_workers": 2, "max_workers": 3,
                    "aggregation_timeout": 600, "fault_tolerance": 1},
    "worker_selection": {"mode": "pool"},
}


def _errors(request: dict) -> dict[str, str]:
    with pytest.raises(ValidationError) as info:
        JobRequested.model_validate(request)
    return {e.field: e.message for e in field_errors(info.value)}


def test_the_documented_request_is_valid_and_gives_the_user_env() -> None:
    spec = JobSpec.model_validate(GOOD)

    assert spec.num_shards == 3
    assert spec.module == "examples.digits.train" and spec.function == "fl_train_model"
    assert spec.env(2) == {"EPOCHS": 1, "BATCH_SIZE": 32, "LEARNING_RATE": 0.01, "STEPS_PER_ROUND": None,
                           "ROUND": 2, "NUM_ROUNDS": 5}


def test_function_defaults_to_fl_train_model() -> None:
    assert JobSpec.model_validate({**GOOD, "entrypoint": "pkg.mod"}).function == "fl_train_model"


def test_each_bad_field_is_named() -> None:
    bad = {**GOOD, "name": "", "entrypoint": "not a path!", "surprise": 1,
           "distributed": {**GOOD["distributed"], "num_rounds": 0, "max_workers": "many"}}

    errors = _errors(bad)

    assert set(errors) >= {"name", "entrypoint", "surprise", "distributed.num_rounds", "distributed.max_workers"}
    assert errors["surprise"] == "unknown field"


def test_missing_entrypoint_is_named() -> None:
    errors = _errors({k: v for k, v in GOOD.items() if k != "entrypoint"})

    assert errors == {"entrypoint": "Field required"}


def test_min_workers_above_max_workers_is_explained() -> None:
    errors = _errors({**GOOD, "distributed": {**GOOD["distributed"], "min_workers": 4}})

    assert "min_workers (4) must not exceed max_workers (3)" in errors["distributed"]


def test_pinned_mode_needs_workers_and_one_shard_each() -> None:
    assert "needs 'workers'" in _errors({**GOOD, "worker_selection": {"mode": "pinned"}})["worker_selection"]
    spec = JobSpec.model_validate({**GOOD, "worker_selection": {"mode": "pinned", "workers": ["a", "b"]}})
    assert spec.num_shards == 2


def test_describe_errors_is_one_line() -> None:
    errors = field_errors(_validation_error({"name": "x", "dataset": "d", "config": {"bad key": 1}}))

    line = describe_errors(errors)

    assert "\n" not in line and line.startswith("entrypoint: ")


def _validation_error(request: dict) -> ValidationError:
    try:
        JobRequested.model_validate(request)
    except ValidationError as e:
        return e
    raise AssertionError("request unexpectedly valid")
