"""`distributed.differential_privacy` in a job: Flower's names and defaults, one-line refusals of what cannot be
private or is out of range, the rounds a budget allows and why a job stops there."""

from __future__ import annotations

from typing import Any

import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from pydantic import ValidationError

from apiary import privacy
from apiary.jobspec import JobSpec, field_errors, strategy_errors
from apiary.privacy import BUDGET_REACHED, DifferentialPrivacy, epsilon, rounds_within_budget
from services.scheduler.evaluation import budget_reason, ending, planned_rounds
from services.scheduler.round_plan import worker_clipping_norm, worker_noise


def request(privacy: dict[str, Any], **distributed: Any) -> dict[str, Any]:
    return {"name": "dp", "entrypoint": "pkg.train", "dataset": "data",
            "distributed": {"max_workers": 4, "num_rounds": 20, **distributed, "differential_privacy": privacy}}


def refusal(privacy: dict[str, Any], **distributed: Any) -> str:
    body = request(privacy, **distributed)
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(body)
    lines = [f"{e.field}: {e.message}" for e in field_errors(caught.value, body)]
    assert len(lines) == 1, lines
    return lines[0]


def test_flowers_defaults_and_num_sampled_clients_from_max_workers() -> None:
    fixed = JobSpec.model_validate(request({"noise_multiplier": 1.0, "clipping_norm": 0.5})).distributed
    adaptive = JobSpec.model_validate(request({"clipping": "adaptive", "noise_multiplier": 0.1})).distributed

    assert fixed.differential_privacy is not None and adaptive.differential_privacy is not None
    assert fixed.differential_privacy.num_sampled_clients == 4 and fixed.differential_privacy.clip_on == "server"
    dp = adaptive.differential_privacy
    # DifferentialPrivacyServerSideAdaptiveClipping's defaults.
    assert (dp.initial_clipping_norm, dp.target_clipped_quantile, dp.clip_norm_lr, dp.clipped_count_stddev) == (
        0.1, 0.5, 0.2, None)
    assert dp.adaptive_noise()[0] == 4 / 20  # clipped_count_stddev: num_sampled_clients / 20


def test_a_stored_spec_validates_again_as_it_was() -> None:
    fixed, adaptive = {"noise_multiplier": 1.0, "clipping_norm": 0.5}, {"clipping": "adaptive", "noise_multiplier": 0.1}
    for settings in (fixed, adaptive):
        spec = JobSpec.model_validate(request(settings))

        assert JobSpec.model_validate(spec.model_dump()) == spec
        assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


@pytest.mark.parametrize(("privacy", "distributed", "expected"), [
    ({"noise_multiplier": 1.0}, {}, "distributed.differential_privacy: clipping 'fixed' needs clipping_norm"),
    ({"noise_multiplier": -0.5, "clipping_norm": 1.0}, {},
     "distributed.differential_privacy.noise_multiplier: Input should be greater than or equal to 0"),
    ({"noise_multiplier": 1.0, "clipping_norm": 0.0}, {},
     "distributed.differential_privacy.clipping_norm: Input should be greater than 0"),
    ({"noise_multiplier": 1.0, "clipping_norm": 1.0, "noise_multipler": 2}, {},
     "distributed.differential_privacy.noise_multipler: unknown field (did you mean noise_multiplier?)"),
    ({"noise_multiplier": 1.0, "clipping": "gaussian", "clipping_norm": 1.0}, {},
     "distributed.differential_privacy.clipping: Input should be 'fixed' or 'adaptive'"),
    ({"noise_multiplier": 1.0, "clipping_norm": 1.0, "clip_norm_lr": 0.5}, {},
     "distributed.differential_privacy: clip_norm_lr: for clipping 'adaptive' only"),
    ({"noise_multiplier": 0.5, "clipping": "adaptive", "clipping_norm": 1.0}, {},
     "distributed.differential_privacy: clipping_norm is for clipping 'fixed'"),
    ({"noise_multiplier": 0.1, "clipping": "adaptive", "target_clipped_quantile": 1.5}, {},
     "distributed.differential_privacy.target_clipped_quantile: Input should be less than or equal to 1"),
    # Flower's adaptive wrapper refuses this noise multiplier: the count's default noise (4/20) leaves no room.
    ({"noise_multiplier": 1.0, "clipping": "adaptive"}, {},
     "distributed: differential_privacy: noise_multiplier 1 needs clipped_count_stddev above 0.5 (it is 0.2"),
    ({"noise_multiplier": 0.1, "clipping": "adaptive", "clip_on": "worker"}, {},
     "distributed.differential_privacy: clip_on 'worker' takes clipping 'fixed'"),
    ({"noise_multiplier": 1.0, "clipping_norm": 1.0, "noise_on": "worker"}, {},
     "distributed.differential_privacy: noise_on 'worker' takes clip_on 'worker'"),
    ({"noise_multiplier": 1.0, "clipping_norm": 1.0, "num_sampled_clients": 5}, {},
     "distributed: differential_privacy: num_sampled_clients (5) must not exceed max_workers (4)"),
    ({"noise_multiplier": 0.0, "clipping_norm": 1.0, "max_epsilon": 3.0}, {},
     "distributed.differential_privacy: max_epsilon needs a noise_multiplier above 0"),
    ({"noise_multiplier": 1.0, "clipping_norm": 1.0, "target_delta": 1.0}, {},
     "distributed.differential_privacy.target_delta: Input should be less than 1"),
])
def test_bad_privacy_settings_are_refused_in_one_line(privacy: dict[str, Any], distributed: dict[str, Any],
                                                      expected: str) -> None:
    assert refusal(privacy, **distributed).startswith(expected)


def test_secure_aggregation_is_not_accepted_silently() -> None:
    body = {"name": "x", "entrypoint": "pkg.train", "dataset": "data", "distributed": {"secure_aggregation": {}}}
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(body)
    assert [e.message for e in field_errors(caught.value, body)] == ["Field required", "Field required"]


def test_without_dp_accounting_differential_privacy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("apiary.jobspec.accounting_available", lambda: False)

    line = refusal({"noise_multiplier": 1.0, "clipping_norm": 1.0})

    assert line == "distributed: differential_privacy needs the dp-accounting package: pip install 'apiary[privacy]'"


def test_a_budget_below_one_round_is_refused_by_the_scheduler() -> None:
    spec = JobSpec.model_validate(request({"noise_multiplier": 1.0, "clipping_norm": 1.0, "max_epsilon": 2.0}))

    errors = strategy_errors(spec)

    assert [e.field for e in errors] == ["distributed.differential_privacy.max_epsilon"]
    assert errors[0].message.startswith("2 is below the ε of a single round (4.729 at target_delta 1e-05)")


def test_epsilon_is_dp_accountings_and_grows_with_the_rounds() -> None:
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_event.GaussianDpEvent(1.3), 7)

    assert epsilon(1.3, 7, 1e-6) == accountant.get_epsilon(1e-6)
    assert epsilon(1.3, 0, 1e-6) == 0.0 and epsilon(0.0, 3, 1e-6) == float("inf")
    assert [epsilon(1.3, r, 1e-6) for r in range(1, 6)] == sorted(epsilon(1.3, r, 1e-6) for r in range(1, 6))


def test_the_budget_sets_the_rounds_and_the_reason_the_job_completes_with() -> None:
    # ε at δ 1e-5, noise multiplier 2: 2.17, 3.19, 4.01, ... after 1, 2, 3 rounds.
    spec = JobSpec.model_validate(request({"noise_multiplier": 2.0, "clipping_norm": 1.0, "max_epsilon": 3.5},
                                          num_rounds=5))
    settings = spec.distributed.differential_privacy
    assert settings is not None

    assert rounds_within_budget(settings, 5) == 2 == planned_rounds(spec)
    assert rounds_within_budget(settings, 1) == 1
    reason = budget_reason(spec, 2)
    assert reason is not None and reason.startswith(f"{BUDGET_REACHED}: ε 3.189 after round 2, round 3 would spend "
                                                    "4.011 > max_epsilon 3.5")
    end = ending(spec, 2, False, {1: {}, 2: {}}, [])
    assert end is not None and end.reason == reason
    assert budget_reason(spec.model_copy(update={"distributed": spec.distributed.model_copy(
        update={"num_rounds": 2})}), 2) is None  # the job's own last round: no budget stopped it


def test_workers_get_the_clipping_norm_only_when_they_clip() -> None:
    on_worker = JobSpec.model_validate(request({"noise_multiplier": 1.0, "clipping_norm": 0.7, "clip_on": "worker"}))
    on_server = JobSpec.model_validate(request({"noise_multiplier": 1.0, "clipping_norm": 0.7}))

    assert worker_clipping_norm(on_worker) == 0.7
    assert worker_clipping_norm(on_server) is None


def test_workers_that_noise_get_the_std_that_adds_up_to_the_central_one_and_a_seed_of_their_own() -> None:
    dp = {"noise_multiplier": 1.5, "clipping_norm": 0.8, "clip_on": "worker", "noise_on": "worker"}
    noised = JobSpec.model_validate(request(dp))  # max_workers 4: m = 4
    seeded_spec = JobSpec.model_validate(request({**dp, "seed": 7}))
    central = JobSpec.model_validate(request({**dp, "noise_on": "server"}))

    assert worker_noise(noised, 2, 1, 0) == {"noise_std": 1.5 * 0.8 / 2}  # z C / sqrt(m): the mean of 4 has z C / 4
    assert worker_noise(central, 2, 1, 0) == {}
    tasks = ((2, 1, 0), (2, 1, 1), (2, 2, 0), (3, 1, 0))
    seeds = {worker_noise(seeded_spec, r, a, s)["noise_seed"] for r, a, s in tasks}
    assert len(seeds) == 4  # each task's noise its own
    assert worker_noise(seeded_spec, 2, 1, 0) == worker_noise(seeded_spec, 2, 1, 0)


def test_noise_on_workers_takes_a_strategy_that_averages() -> None:
    dp = {"noise_multiplier": 1.0, "clipping_norm": 1.0, "clip_on": "worker", "noise_on": "worker"}
    median = JobSpec.model_validate(request(dp, strategy="fedmedian"))
    adam = JobSpec.model_validate(request(dp, strategy="fedadam"))

    errors = strategy_errors(median)

    assert [e.field for e in errors] == ["distributed.differential_privacy.noise_on"]
    assert errors[0].message.startswith("'worker' takes a strategy that averages the updates")
    assert strategy_errors(adam) == []


def test_secure_aggregation_refuses_a_clipping_range_that_would_clip_the_workers_noise() -> None:
    dp = {"noise_multiplier": 1.0, "clipping_norm": 8.0, "clip_on": "worker", "noise_on": "worker"}  # std 4

    line = refusal(dp, secure_aggregation={"num_shares": 3, "reconstruction_threshold": 2})

    assert line == ("distributed: secure_aggregation: clipping_range 8 would clip the workers' noise "
                    "(differential_privacy noise_on worker: std 4 per value) before quantisation: raise clipping_range "
                    "above 16 or noise on the server")
    JobSpec.model_validate(request(dp, secure_aggregation={"num_shares": 3, "reconstruction_threshold": 2,
                                                           "clipping_range": 16.5}))


def test_settings_are_flowers_names() -> None:
    # The wrapper's parameters in Flower 1.42 (DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping), plus
    # Apiary's own: where to clip, the accountant's δ and budget, and the test-only seed.
    ours = set(DifferentialPrivacy.model_fields)
    flowers = {"noise_multiplier", "clipping_norm", "num_sampled_clients", "initial_clipping_norm",
               "target_clipped_quantile", "clip_norm_lr", "clipped_count_stddev"}
    assert flowers <= ours
    assert ours - flowers == {"clipping", "clip_on", "noise_on", "target_delta", "max_epsilon", "seed"}
    assert privacy.DEFAULT_TARGET_DELTA == 1e-5
