"""The documented request (issue 16) validates as is: registry ids, the built-in trainer's config, mixed
worker selection and `distributed.enabled`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from apiary.contracts import JobRequested
from apiary.jobspec import CAUSAL_LM, JobSpec, describe_errors, field_errors
from services.app.jobfile import load_job_file

DOCUMENTED: dict[str, Any] = {
    "name": "distributed-llama-finetune",
    "dataset_id": 42,
    "model_id": 7,
    "config": {"epochs": 3, "batch_size": 4, "learning_rate": 2e-4, "mixed_precision": "bf16", "use_peft": True,
               "lora_r": 16, "lora_alpha": 32},
    "distributed": {"enabled": True, "strategy": "federated_averaging", "num_rounds": 10, "steps_per_round": 500,
                    "min_workers": 2, "max_workers": 5, "aggregation_timeout": 600, "fault_tolerance": 1},
    "worker_selection": {"mode": "mixed", "worker_ids": [1, 3], "parsyn_worker_ids": [5]},
}


def _errors(request: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        JobRequested.model_validate(request)
    return describe_errors(field_errors(caught.value))


def test_the_documented_body_validates_as_a_built_in_job_on_the_listed_workers() -> None:
    spec = JobRequested.model_validate(copy.deepcopy(DOCUMENTED))

    assert (spec.dataset_id, spec.model_id, spec.entrypoint, spec.trainer) == (42, 7, None, CAUSAL_LM)
    assert spec.adapter_only and spec.built_in is not None and spec.built_in.lora_r == 16
    assert spec.worker_selection.pinned == ["1", "3", "5"] and spec.num_shards == 3
    assert spec.worker_selection.kinds == {"1": "own", "3": "own", "5": "platform"}


@pytest.mark.parametrize("given", [42, "42"])
def test_ids_are_integers_or_strings_of_digits(given: int | str) -> None:
    spec = JobSpec.model_validate({**DOCUMENTED, "dataset_id": given, "model_id": str(given)})

    assert spec.dataset_id == 42 and spec.model_id == 42


def test_an_id_that_is_no_id_is_named() -> None:
    assert _errors({**DOCUMENTED, "dataset_id": "4 2"}).startswith("dataset_id: expected an integer id")


def test_unknown_and_bad_config_keys_each_get_a_line_naming_the_closest_key() -> None:
    line = _errors({**DOCUMENTED, "config": {"lora_rr": 8, "mixed_precision": "fp8"}, "surprise": 1})

    assert "config.lora_rr: unknown field (did you mean lora_r?)" in line
    assert "config.mixed_precision: " in line and "surprise: unknown field" in line


def test_a_user_code_job_keeps_its_free_form_config() -> None:
    spec = JobSpec.model_validate({**DOCUMENTED, "entrypoint": "pkg.mod:fl_train_model", "config": {"lr": 1}})

    assert spec.trainer is None and spec.built_in is None and not spec.adapter_only


def test_a_request_with_neither_entrypoint_nor_model_misses_its_entrypoint() -> None:
    request = {k: v for k, v in DOCUMENTED.items() if k != "model_id"}

    assert _errors(request) == "entrypoint: Field required"


def test_not_distributed_is_one_shard_on_one_worker() -> None:
    spec = JobSpec.model_validate({**DOCUMENTED, "worker_selection": {"mode": "pool"},
                                   "distributed": {"enabled": False, "min_workers": 3, "max_workers": 2}})

    assert (spec.num_shards, spec.distributed.min_workers, spec.distributed.max_workers) == (1, 1, 1)


def test_mixed_mode_needs_workers_and_names_each_once() -> None:
    assert "mode 'mixed' needs" in _errors({**DOCUMENTED, "worker_selection": {"mode": "mixed"}})
    twice = {"mode": "mixed", "worker_ids": [1], "parsyn_worker_ids": ["1"]}
    assert "names a worker twice" in _errors({**DOCUMENTED, "worker_selection": twice})


def test_pool_and_pinned_keep_working() -> None:
    pinned = JobSpec.model_validate({**DOCUMENTED, "worker_selection": {"mode": "pinned", "workers": ["a", "b"]}})
    pool = JobSpec.model_validate({**DOCUMENTED, "worker_selection": {}})

    assert pinned.num_shards == 2 and pool.num_shards == 5 and pool.worker_selection.kinds == {}


def test_a_job_file_holding_the_documented_body_validates(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(DOCUMENTED))

    spec = JobRequested.model_validate(load_job_file(path))

    assert (spec.model_id, spec.trainer, spec.worker_selection.pinned) == (7, CAUSAL_LM, ["1", "3", "5"])
