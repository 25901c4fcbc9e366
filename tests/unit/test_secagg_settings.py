"""`distributed.secure_aggregation` in a job: Flower 1.42's SecAgg+ names and defaults, and one-line refusals of
what is out of range or cannot run on a masked sum."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from apiary.jobspec import JobSpec, field_errors, strategy_errors
from apiary.secagg.settings import SUMMING_STRATEGIES, SecureAggregation

FLOWER_SECAGGPLUS_DEFAULTS = {"max_weight": 1000.0, "clipping_range": 8.0, "quantization_range": 4194304,
                              "modulus_range": 4294967296, "timeout": None}


def request(secagg: dict[str, Any], **distributed: Any) -> dict[str, Any]:
    return {"name": "sa", "entrypoint": "pkg.train", "dataset": "data",
            "distributed": {"max_workers": 4, "num_rounds": 2, **distributed, "secure_aggregation": secagg}}


def refusal(secagg: dict[str, Any], **distributed: Any) -> str:
    body = request(secagg, **distributed)
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(body)
    lines = [f"{e.field}: {e.message}" for e in field_errors(caught.value, body)]
    assert len(lines) == 1, lines
    assert "\n" not in lines[0]
    return lines[0]


def test_flowers_names_and_defaults() -> None:
    spec = JobSpec.model_validate(request({"num_shares": 3, "reconstruction_threshold": 2}))

    settings = spec.distributed.secure_aggregation
    assert settings is not None
    assert {name: getattr(settings, name) for name in FLOWER_SECAGGPLUS_DEFAULTS} == FLOWER_SECAGGPLUS_DEFAULTS
    resolved = settings.resolved(4)
    assert (resolved.num_shares, resolved.threshold, resolved.dropouts_tolerated) == (3, 2, 1)


def test_fractions_resolve_as_flowers_workflow() -> None:
    # SecAggPlusWorkflow.setup_stage: round(fraction * workers), made odd below all; threshold at least 2.
    settings = SecureAggregation(num_shares=0.5, reconstruction_threshold=0.7)

    assert (settings.resolved(10).num_shares, settings.resolved(10).threshold) == (5, 4)
    assert (settings.resolved(4).num_shares, settings.resolved(4).threshold) == (3, 2)
    assert SecureAggregation(num_shares=1, reconstruction_threshold=1.0).resolved(16).num_shares == 16


def test_a_stored_spec_validates_again_as_it_was() -> None:
    spec = JobSpec.model_validate(request({"num_shares": 0.75, "reconstruction_threshold": 2}))

    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


@pytest.mark.parametrize(("secagg", "distributed", "expected"), [
    ({"num_shares": 3, "reconstruction_threshold": 5}, {"max_workers": 8},
     "distributed.secure_aggregation: reconstruction_threshold (5) must be below num_shares (3)"),
    ({"num_shares": 1, "reconstruction_threshold": 6}, {},
     "distributed: secure_aggregation: reconstruction_threshold (6) must not exceed num_shares (4) for 4 workers"),
    ({"num_shares": 6, "reconstruction_threshold": 3}, {},
     "distributed: secure_aggregation: num_shares (6) must not exceed the round's workers (4)"),
    ({"num_shares": 3, "reconstruction_threshold": 2}, {"strategy": "krum"},
     "distributed: secure_aggregation: strategy 'krum' picks one update by its distances to the others, which "
     "needs every update in the clear: secure aggregation takes a weighted-sum strategy (federated_averaging, "
     "fedprox, fedavgm, fedadam, fedyogi, fedadagrad)"),
    ({"num_shares": 3, "reconstruction_threshold": 2}, {"strategy": "fedmedian"},
     "distributed: secure_aggregation: strategy 'fedmedian' takes a coordinate-wise median, which needs every"),
    ({"num_shares": 2, "reconstruction_threshold": 1}, {},
     "distributed.secure_aggregation: num_shares 2 must be 1 (all workers) or above 2"),
    ({"num_shares": 3, "reconstruction_threshold": 2, "modulus_range": 3000000000}, {},
     "distributed.secure_aggregation: modulus_range 3000000000 must be a power of 2"),
    ({"num_shares": 3, "reconstruction_threshold": 2, "modulus_range": 2**40}, {},
     "distributed.secure_aggregation: modulus_range 1099511627776 must be at most 2**32"),
    ({"num_shares": 3, "reconstruction_threshold": 2, "quantization_range": 2**30}, {},
     "distributed: secure_aggregation: 4 workers x quantization_range 1073741824 would wrap modulus_range"),
    ({"num_shares": 3, "reconstruction_threshold": 2, "clipping_range": 0}, {},
     "distributed.secure_aggregation.clipping_range: Input should be greater than 0"),
    ({"num_shares": 3, "reconstruction_threshold": 2, "threshold": 2}, {},
     "distributed.secure_aggregation.threshold: unknown field"),
    ({"reconstruction_threshold": 2}, {}, "distributed.secure_aggregation.num_shares: Field required"),
    ({"num_shares": 1, "reconstruction_threshold": 1}, {"max_workers": 1},
     "distributed: secure_aggregation: secure aggregation needs at least 2 workers a round"),
    ({"num_shares": 3, "reconstruction_threshold": 2},
     {"differential_privacy": {"noise_multiplier": 1.0, "clipping_norm": 1.0}},
     "distributed: secure_aggregation: with differential_privacy needs clip_on 'worker': the aggregator never sees"),
    ({"num_shares": 3, "reconstruction_threshold": 2}, {"transfer": {"upload": "int8_blockwise"}},
     "distributed: secure_aggregation: workers upload masked vectors of their own encoding"),
    ({"num_shares": 3, "reconstruction_threshold": 2}, {"transfer": {"delta": True}},
     "distributed: secure_aggregation: workers upload masked vectors of their own encoding"),
    ({"num_shares": 3, "reconstruction_threshold": 2}, {"personal_layers": ["head.*"]},
     "distributed: secure_aggregation: masks every tensor of the model; personal_layers keep some out"),
])
def test_bad_settings_are_refused_in_one_line(secagg: dict[str, Any], distributed: dict[str, Any],
                                              expected: str) -> None:
    assert refusal(secagg, **distributed).startswith(expected)


@pytest.mark.parametrize("strategy", [*SUMMING_STRATEGIES, "fedavg"])
def test_every_weighted_sum_strategy_is_taken(strategy: str) -> None:
    spec = JobSpec.model_validate(request({"num_shares": 1, "reconstruction_threshold": 2}, strategy=strategy))

    assert spec.distributed.secure_aggregation is not None


def test_differential_privacy_clipped_on_workers_composes() -> None:
    dp = {"noise_multiplier": 1.0, "clipping_norm": 1.0, "clip_on": "worker"}

    spec = JobSpec.model_validate(request({"num_shares": 1, "reconstruction_threshold": 2}, differential_privacy=dp))

    assert spec.distributed.secure_aggregation is not None and spec.distributed.differential_privacy is not None



def test_the_scheduler_takes_it() -> None:
    spec = JobSpec.model_validate(request({"num_shares": 3, "reconstruction_threshold": 2}))

    assert strategy_errors(spec) == []


def test_an_adapter_only_job_is_refused_by_the_scheduler() -> None:
    spec = JobSpec.model_validate({**request({"num_shares": 3, "reconstruction_threshold": 2}), "use_peft": True})

    errors = strategy_errors(spec)

    assert [e.field for e in errors] == ["distributed.secure_aggregation"]
    assert errors[0].message.startswith("takes full-weight updates; an adapter-only job")
