"""Central differential privacy around a strategy: fixed clipping against Flower 1.42's wrappers, adaptive
clipping against Andrew et al. 2021's formula, the noise's std and precision, ε against dp-accounting and
Flower's RdpAccountant, and the server state a restart resumes from.

The measure against Flower is test_strategies_flower.py's: each tensor's largest difference relative to its
largest value, <= 1e-6 (float32 rounding; the update's norm is summed in float64 here, in float32 by numpy).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
)
from flwr.serverapp import RdpAccountant
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)

from apiary.privacy import DifferentialPrivacy
from apiary.strategies.base import Contribution, ContributionList, RoundResult, create
from apiary.strategies.clipping import clip_for_upload, update_norm
from apiary.strategies.format import UpdateFormat
from apiary.strategies.private import EPSILON, NOISE_STD, NORM, DifferentiallyPrivate, adapted_norm, seeded
from apiary.strategies.validation import InvalidContribution
from apiary.weights import spec_of_tensors
from tests.unit.test_strategies_flower import as_flower, assert_matches, model

ROUNDS = 4
WORKERS = 5


def contributions(global_weights: dict[str, torch.Tensor], seed: int, spread: float = 0.1) -> list[Contribution]:
    """Workers' results whose updates' norms straddle the clipping norms used here (about 1 to 8)."""
    gen = torch.Generator().manual_seed(seed)
    return [Contribution({name: t + spread * (i + 1) * torch.randn(t.shape, generator=gen)
                          for name, t in global_weights.items()}, samples=3 + 5 * i) for i in range(WORKERS)]


def settings(**overrides: Any) -> DifferentialPrivacy:
    values: dict[str, Any] = {"noise_multiplier": 0.0, "clipping_norm": 2.0, **overrides}
    return DifferentialPrivacy.model_validate(values).resolved(WORKERS)


def private_round(name: str, params: dict[str, Any], dp: DifferentialPrivacy, global_weights: dict[str, torch.Tensor],
                  round_in: list[Contribution], state: dict[str, torch.Tensor]) -> tuple[RoundResult, dict]:
    """One round on a fresh wrapped strategy restored from the last round's state, as the aggregator runs it."""
    strategy = DifferentiallyPrivate(create(name, params), dp)
    strategy.load_state(state)
    strategy.begin(spec_of_tensors(global_weights), UpdateFormat.FULL, global_weights)
    for contribution in round_in:
        strategy.accept(contribution)
    result = strategy.finish(None, ContributionList(round_in))
    return result, {key: tensor.clone() for key, tensor in strategy.state().items()}


FLOWER_INNER: dict[str, tuple[str, dict[str, Any], Any]] = {
    "federated_averaging": ("federated_averaging", {}, lambda init: FedAvg()),
    "fedavgm": ("fedavgm", {"server_learning_rate": 0.7, "server_momentum": 0.9},
                lambda init: FedAvgM(initial_parameters=init, server_learning_rate=0.7, server_momentum=0.9)),
    "fedadam": ("fedadam", {"eta": 0.05, "tau": 1e-3},
                lambda init: FedAdam(initial_parameters=init, eta=0.05, tau=1e-3)),
    "fedmedian": ("fedmedian", {}, lambda init: FedMedian()),
}


@pytest.mark.parametrize("case", sorted(FLOWER_INNER))
def test_fixed_clipping_matches_flowers_wrapper_round_after_round(case: str) -> None:
    name, params, make_inner = FLOWER_INNER[case]
    global_weights, state = model(0), {}
    initial = [t.numpy().copy() for t in global_weights.values()]
    flower = DifferentialPrivacyServerSideFixedClipping(make_inner(ndarrays_to_parameters(initial)),
                                                        noise_multiplier=0.0, clipping_norm=2.0,
                                                        num_sampled_clients=WORKERS)
    clipped_somewhere = False
    for round_number in range(1, ROUNDS + 1):
        round_in = contributions(global_weights, seed=round_number)
        norms = [update_norm(c.weights, global_weights) for c in round_in]
        clipped_somewhere |= max(norms) > 2.0 > min(norms)
        result, state = private_round(name, params, settings(), global_weights, round_in, state)
        flower.current_round_params = [t.numpy().copy() for t in global_weights.values()]
        if isinstance(flower.strategy, FedAdam):  # it keeps its own weights in float64: start from Apiary's float32
            flower.strategy.current_weights = [t.numpy().copy() for t in global_weights.values()]
        reference, _ = flower.aggregate_fit(round_number, as_flower(round_in), [])

        assert reference is not None
        assert_matches(result.weights, parameters_to_ndarrays(reference))
        assert result.metrics[NORM] == 2.0 and EPSILON not in result.metrics  # no noise: no finite ε
        global_weights = result.weights
    assert clipped_somewhere  # some updates were clipped and some were not: both paths are compared


def test_clipping_on_workers_gives_flowers_client_side_result() -> None:
    global_weights, state = model(3), {}
    flower = DifferentialPrivacyClientSideFixedClipping(FedAvg(), noise_multiplier=0.0, clipping_norm=2.0,
                                                        num_sampled_clients=WORKERS)
    for round_number in range(1, ROUNDS + 1):
        round_in = contributions(global_weights, seed=10 + round_number)
        uploaded = [Contribution(clip_for_upload(c.weights, global_weights, 2.0)[0], c.samples) for c in round_in]
        result, state = private_round("federated_averaging", {}, settings(clip_on="worker"), global_weights, uploaded,
                                      state)
        # Flower's fixedclipping_mod clips on the client the same way: its server-side wrapper then only adds noise.
        reference, _ = flower.aggregate_fit(round_number, as_flower(uploaded), [])

        assert reference is not None
        assert_matches(result.weights, parameters_to_ndarrays(reference))
        global_weights = result.weights


def test_an_update_over_the_norm_is_refused_when_workers_clip() -> None:
    global_weights = model(4)
    strategy = DifferentiallyPrivate(create("federated_averaging"), settings(clip_on="worker"))
    strategy.begin(spec_of_tensors(global_weights), UpdateFormat.FULL, global_weights)
    unclipped = contributions(global_weights, seed=1, spread=1.0)[2]

    with pytest.raises(InvalidContribution, match="over the clipping norm 2"):
        strategy.accept(unclipped)
    clipped, within = clip_for_upload(unclipped.weights, global_weights, 2.0)
    strategy.accept(Contribution(clipped, unclipped.samples))

    assert not within and update_norm(clipped, global_weights) <= 2.0
    assert strategy.total_samples == unclipped.samples


def noise_free_mean(round_in: list[Contribution], global_weights: dict[str, torch.Tensor],
                    norm: float) -> dict[str, torch.Tensor]:
    """The sample-weighted mean of the clipped contributions, in float64."""
    from apiary.strategies.clipping import clipped

    total = sum(c.samples for c in round_in)
    out = {name: torch.zeros(t.shape, dtype=torch.float64) for name, t in global_weights.items()}
    for c in round_in:
        for name, tensor in clipped(c.weights, global_weights, norm).items():
            out[name] += c.samples * tensor.double()
    return {name: t / total for name, t in out.items()}


def test_noise_has_std_z_c_over_m_in_float64_and_a_seed_reproduces_it() -> None:
    global_weights = model(5)
    round_in = contributions(global_weights, seed=5)
    dp = settings(noise_multiplier=1.5, clipping_norm=3.0, seed=1234)

    result, _ = private_round("federated_averaging", {}, dp, global_weights, round_in, {})
    again, _ = private_round("federated_averaging", {}, dp, global_weights, round_in, {})

    std = 1.5 * 3.0 / WORKERS
    assert result.metrics[NOISE_STD] == pytest.approx(std, rel=1e-15)
    # The same draws, from (seed, release 0, name), added to the float64 mean and rounded once.
    mean = noise_free_mean(round_in, global_weights, 3.0)
    for name, tensor in result.weights.items():
        noise = seeded(1234, 0, name).normal(0.0, std, tuple(tensor.shape))
        expected = (mean[name] + torch.from_numpy(noise)).float()
        assert torch.equal(tensor, expected), name
        assert torch.equal(tensor, again.weights[name])
    residual = torch.cat([(result.weights[n].double() - mean[n]).flatten() for n in mean])
    assert float(residual.std()) == pytest.approx(std, rel=0.1)


def test_noise_without_a_seed_differs_every_time() -> None:
    global_weights = model(6)
    round_in = contributions(global_weights, seed=6)
    dp = settings(noise_multiplier=1.0)

    first, _ = private_round("federated_averaging", {}, dp, global_weights, round_in, {})
    second, _ = private_round("federated_averaging", {}, dp, global_weights, round_in, {})

    assert not torch.equal(first.weights["fc.weight"], second.weights["fc.weight"])


def test_a_server_optimiser_steps_from_the_noised_mean() -> None:
    # FedAvgM with server_learning_rate 1 and no momentum takes the mean as is: noise on the mean and on the
    # result agree; with a step, the noise is on the mean (the step post-processes a private release).
    global_weights = model(7)
    round_in = contributions(global_weights, seed=7)
    dp = settings(noise_multiplier=1.0, seed=99)
    params = {"server_learning_rate": 0.5}

    result, _ = private_round("fedavgm", params, dp, global_weights, round_in, {})

    mean = noise_free_mean(round_in, global_weights, 2.0)
    for name, tensor in result.weights.items():
        noise = seeded(99, 0, name).normal(0.0, 1.0 * 2.0 / WORKERS, tuple(tensor.shape))
        noised = (mean[name] + torch.from_numpy(noise)).float()
        expected = global_weights[name] - 0.5 * (global_weights[name] - noised)
        assert torch.allclose(tensor, expected, rtol=0, atol=1e-6), name


def test_adaptive_clipping_follows_the_papers_rule_round_after_round() -> None:
    # Andrew et al. 2021: C <- C * exp(-lr * ((#unclipped + N(0, sigma_b^2)) / m - target)), noise z_update*C/m.
    dp = settings(clipping="adaptive", clipping_norm=None, noise_multiplier=0.5, clipped_count_stddev=2.0,
                  initial_clipping_norm=1.0, target_clipped_quantile=0.6, clip_norm_lr=0.3, seed=7)
    z_update = (0.5 ** -2 - (2 * 2.0) ** -2) ** -0.5
    global_weights, state, norm = model(8), {}, 1.0
    for round_number in range(ROUNDS):
        round_in = contributions(global_weights, seed=20 + round_number)
        unclipped = sum(update_norm(c.weights, global_weights) <= norm for c in round_in)
        result, state = private_round("federated_averaging", {}, dp, global_weights, round_in, state)

        fraction = (unclipped + seeded(7, round_number).normal(0.0, 2.0)) / WORKERS
        expected = norm * math.exp(-0.3 * (fraction - 0.6))
        assert result.metrics[NORM] == norm
        assert result.metrics[NOISE_STD] == pytest.approx(z_update * norm / WORKERS, rel=1e-15)
        assert float(state["dp.clipping_norm"]) == pytest.approx(expected, rel=1e-12)
        norm, global_weights = expected, result.weights


def test_adaptive_norm_grows_when_every_update_is_clipped_where_flowers_shrinks() -> None:
    global_weights = model(9)
    round_in = contributions(global_weights, seed=9, spread=1.0)  # every update far over 0.1
    dp = settings(clipping="adaptive", clipping_norm=None, noise_multiplier=0.0)  # Flower's defaults otherwise
    flower = DifferentialPrivacyServerSideAdaptiveClipping(FedAvg(), noise_multiplier=0.0,
                                                           num_sampled_clients=WORKERS)
    flower.current_round_params = [t.numpy().copy() for t in global_weights.values()]

    _, state = private_round("federated_averaging", {}, dp, global_weights, round_in, {})
    flower.aggregate_fit(1, as_flower(round_in), [])

    # No update fits within 0.1: the paper moves the norm up, exp(0.2 * 0.5); Flower's counts them the other way.
    assert float(state["dp.clipping_norm"]) == pytest.approx(0.1 * math.exp(0.2 * 0.5), rel=1e-12)
    assert flower.clipping_norm == pytest.approx(0.1 * math.exp(-0.2 * 0.5), rel=1e-12)
    assert adapted_norm(1.0, 1.0, 0.5, 0.2) < 1.0 < adapted_norm(1.0, 0.0, 0.5, 0.2)


@pytest.mark.parametrize(("z", "delta"), [(0.5, 1e-5), (1.0, 1e-5), (2.0, 1e-6), (1.1, 1e-3)])
def test_epsilon_after_each_round_is_dp_accountings_and_flowers(z: float, delta: float) -> None:
    dp = settings(noise_multiplier=z, target_delta=delta, seed=1)
    global_weights, state = model(10), {}
    flower = RdpAccountant(PrivacyConfig(target_delta=delta, population_size=WORKERS,
                                         neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                         sampling_method=SamplingMethod.NO_AMPLIFICATION))
    for rounds in range(1, 6):
        result, state = private_round("federated_averaging", {}, dp, global_weights, contributions(global_weights,
                                                                                                   seed=rounds), state)
        own = rdp_privacy_accountant.RdpAccountant()
        own.compose(dp_event.GaussianDpEvent(z), rounds)
        flower.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=WORKERS, population_size=WORKERS))

        assert int(state["dp.releases"]) == rounds
        assert abs(result.metrics[EPSILON] - own.get_epsilon(delta)) <= 1e-9
        assert abs(result.metrics[EPSILON] - flower.get_epsilon(delta)) <= 1e-9


def test_a_restarted_wrapper_resumes_with_the_same_norm_and_epsilon() -> None:
    dp = settings(clipping="adaptive", clipping_norm=None, noise_multiplier=0.3, initial_clipping_norm=0.5, seed=3)
    global_weights, state = model(11), {}
    for round_number in range(3):
        result, state = private_round("fedavgm", {"server_momentum": 0.5}, dp, global_weights,
                                      contributions(global_weights, seed=30 + round_number), state)
        global_weights = result.weights

    restored = DifferentiallyPrivate(create("fedavgm", {"server_momentum": 0.5}), dp)
    restored.load_state(state)

    assert restored.clipping_norm == float(state["dp.clipping_norm"]) != 0.5
    assert restored.releases == 3
    assert restored.state().keys() == state.keys()
    assert all(torch.equal(restored.state()[k], state[k]) for k in state)


def test_adapter_rounds_clip_and_noise_the_adapter_tensors_only() -> None:
    global_weights = model(12)
    adapter = ("fc.weight", "fc.bias")
    round_in = [Contribution({n: c.weights[n] for n in adapter}, c.samples)
                for c in contributions(global_weights, seed=12, spread=1.0)]
    strategy = DifferentiallyPrivate(create("federated_averaging"), settings(noise_multiplier=1.0, seed=5))
    strategy.begin(spec_of_tensors(global_weights), UpdateFormat.ADAPTER, global_weights)
    for contribution in round_in:
        strategy.accept(contribution)

    result = strategy.finish()

    assert torch.equal(result.weights["conv.weight"], global_weights["conv.weight"])
    mean = noise_free_mean(round_in, {n: global_weights[n] for n in adapter}, 2.0)
    for name in adapter:
        noise = torch.from_numpy(seeded(5, 0, name).normal(0.0, 2.0 / WORKERS, tuple(global_weights[name].shape)))
        assert torch.equal(result.weights[name], (mean[name] + noise).float())


def test_noise_on_workers_is_not_added_again_and_the_mean_reports_the_std_it_carries() -> None:
    global_weights = model(6)
    dp = settings(noise_multiplier=1.5, clipping_norm=2.0, clip_on="worker", noise_on="worker", seed=3)
    sigma = dp.worker_noise_std
    uploaded = []
    for i, c in enumerate(contributions(global_weights, seed=6)):
        clipped_weights, _ = clip_for_upload(c.weights, global_weights, 2.0)
        noised = {n: (t.double() + torch.from_numpy(seeded(i, 0, n).normal(0.0, sigma, tuple(t.shape)))).float()
                  for n, t in clipped_weights.items()}
        uploaded.append(Contribution(noised, c.samples))

    result, _ = private_round("federated_averaging", {}, dp, global_weights, uploaded, {})
    plain, _ = private_round("federated_averaging", {}, settings(noise_multiplier=0.0, clipping_norm=1e9),
                             global_weights, uploaded, {})

    assert sigma == pytest.approx(1.5 * 2.0 / math.sqrt(WORKERS), rel=1e-15)
    for name, tensor in result.weights.items():
        assert torch.equal(tensor, plain.weights[name]), name  # the workers' noise only: nothing added here
    samples = [c.samples for c in uploaded]
    assert result.metrics[NOISE_STD] == pytest.approx(sigma * math.sqrt(sum(n * n for n in samples)) / sum(samples))
    assert result.metrics[EPSILON] > 0  # accounted as z, as central noise is


def test_an_unclipped_update_is_refused_even_with_the_workers_noise() -> None:
    global_weights = model(7)
    dp = settings(noise_multiplier=0.1, clipping_norm=2.0, clip_on="worker", noise_on="worker")
    strategy = DifferentiallyPrivate(create("federated_averaging"), dp)
    strategy.begin(spec_of_tensors(global_weights), UpdateFormat.FULL, global_weights)
    unclipped = contributions(global_weights, seed=1, spread=1.0)[2]
    clipped_weights, _ = clip_for_upload(unclipped.weights, global_weights, 2.0)
    gen = torch.Generator().manual_seed(0)
    honest = {n: t + dp.worker_noise_std * torch.randn(t.shape, generator=gen) for n, t in clipped_weights.items()}

    assert update_norm(unclipped.weights, global_weights) > 4 * 2.0
    with pytest.raises(InvalidContribution, match=r"the most a clipped update .* with the workers' noise"):
        strategy.accept(unclipped)
    strategy.accept(Contribution(honest, unclipped.samples))  # clipped, then noised: within the bound

    assert update_norm(honest, global_weights) > 2.0  # over the norm itself: the noise's share is allowed for
    assert strategy.total_samples == unclipped.samples
