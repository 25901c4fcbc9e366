"""Every strategy's new global weights against Flower 1.42's implementation on the same inputs.

Flower is a test-only dependency. Its FedAvgM, median, trimmed mean and Krum work in the model's
float32; its FedOpt family in float64 (FedAvg's in-place aggregate scales by float64 factors), while
Apiary keeps the model's float32 throughout. So the measure is each tensor's largest difference
relative to its largest value, `max|apiary - flower| / max|flower|` <= 1e-6, which float32 rounding
(~6e-8 an operation) meets and any real difference in the maths does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAdagrad, FedAdam, FedAvgM, FedProx, FedYogi
from flwr.server.strategy.aggregate import aggregate_krum, aggregate_median, aggregate_trimmed_avg

from apiary.strategies import readback
from apiary.strategies.base import Contribution, ContributionList, RoundResult, create
from apiary.strategies.format import UpdateFormat
from apiary.weights import spec_of_tensors

SHAPES = {"conv.weight": (4, 3, 3), "conv.bias": (4,), "fc.weight": (10, 30), "fc.bias": (10,)}
ROUNDS = 4


def model(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def contributions(global_weights: dict[str, torch.Tensor], count: int, seed: int) -> list[Contribution]:
    """Workers' results spread around the global weights, with distinct sample counts."""
    gen = torch.Generator().manual_seed(seed)
    return [Contribution({name: t + 0.1 * (i + 1) * torch.randn(t.shape, generator=gen)
                          for name, t in global_weights.items()}, samples=3 + 5 * i) for i in range(count)]


def apiary_round(strategy_name: str, params: dict[str, Any], global_weights: dict[str, torch.Tensor],
                 round_in: list[Contribution], state: dict[str, torch.Tensor]) -> tuple[RoundResult, dict]:
    """One round on a fresh strategy restored from the last round's state, as the aggregator runs it."""
    strategy = create(strategy_name, params)
    strategy.load_state(state)
    strategy.begin(spec_of_tensors(global_weights), UpdateFormat.FULL)
    for contribution in round_in:
        strategy.accept(contribution)
    result = strategy.finish(global_weights, ContributionList(round_in))
    return result, {name: tensor.clone() for name, tensor in strategy.state().items()}


def as_flower(round_in: list[Contribution]) -> list[tuple[Any, FitRes]]:
    return [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([t.numpy() for t in c.weights.values()]),
                          c.samples, {})) for c in round_in]


def as_results(round_in: list[Contribution]) -> list[tuple[list[np.ndarray], int]]:
    return [([t.numpy() for t in c.weights.values()], c.samples) for c in round_in]


def assert_matches(ours: dict[str, torch.Tensor], flower: list[np.ndarray]) -> None:
    for (name, tensor), reference in zip(ours.items(), flower, strict=True):
        expected = torch.from_numpy(np.asarray(reference, dtype=np.float64))
        assert tensor.dtype == torch.float32 and tensor.shape == expected.shape, name
        error = (tensor.double() - expected).abs().max() / expected.abs().max()
        assert error <= 1e-6, f"{name}: relative error {float(error):.2e}"


MOMENTS = {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.9, "tau": 1e-4}
FLOWER_SERVER: dict[str, tuple[Any, dict[str, Any]]] = {
    "fedavgm": (FedAvgM, {"server_learning_rate": 0.7, "server_momentum": 0.9}),
    "fedavgm lr": (FedAvgM, {"server_learning_rate": 1.5}),
    "fedavgm defaults": (FedAvgM, {}),
    "fedprox": (FedProx, {"proximal_mu": 0.1}),
    "fedadam": (FedAdam, {}),
    "fedadam moments": (FedAdam, MOMENTS),
    "fedyogi": (FedYogi, {}),
    "fedyogi moments": (FedYogi, MOMENTS),
    "fedadagrad": (FedAdagrad, {}),
    "fedadagrad eta": (FedAdagrad, {"eta": 0.3, "eta_l": 0.01, "tau": 1e-3}),
}


@pytest.mark.parametrize("case", sorted(FLOWER_SERVER))
def test_a_server_optimiser_matches_flower_round_after_round(case: str) -> None:
    flower_class, params = FLOWER_SERVER[case]
    name = case.split()[0]
    global_weights, state = model(0), {}
    flower = flower_class(initial_parameters=ndarrays_to_parameters([t.numpy() for t in global_weights.values()]),
                          **params)

    for round_number in range(1, ROUNDS + 1):
        round_in = contributions(global_weights, 5, seed=round_number)
        result, state = apiary_round(name, params, global_weights, round_in, state)
        # Both start the round from the same global weights, the float32 model Apiary stores: Flower's
        # FedOpt keeps its own in float64, and a large step (eta 0.3 on deltas of 0.1) would amplify
        # that rounding round after round. Its server state (momentum, m_t, v_t) stays its own.
        flower.current_weights = [t.numpy() for t in global_weights.values()]
        flower.initial_parameters = ndarrays_to_parameters(flower.current_weights)
        reference, _ = flower.aggregate_fit(round_number, as_flower(round_in), [])

        assert reference is not None
        assert_matches(result.weights, parameters_to_ndarrays(reference))
        global_weights = result.weights


ORDER_STATISTICS: dict[str, tuple[dict[str, Any], Callable[[list], list[np.ndarray]]]] = {
    "fedmedian": ({}, aggregate_median),
    "fedtrimmedavg": ({}, lambda results: aggregate_trimmed_avg(results, 0.2)),
    "fedtrimmedavg beta=0.34": ({"beta": 0.34}, lambda results: aggregate_trimmed_avg(results, 0.34)),
    "krum": ({"num_malicious_nodes": 2}, lambda results: aggregate_krum(results, 2, 0)),
    "krum keep=3": ({"num_malicious_nodes": 1, "num_nodes_to_keep": 3}, lambda results: aggregate_krum(results, 1, 3)),
    "multikrum": ({"num_malicious_nodes": 2}, lambda results: aggregate_krum(results, 2, len(results) - 2)),
    "multikrum keep=4": ({"num_malicious_nodes": 2, "num_nodes_to_keep": 4},
                         lambda results: aggregate_krum(results, 2, 4)),
}


@pytest.mark.parametrize("case", sorted(ORDER_STATISTICS))
@pytest.mark.parametrize("count", [9, 10])
def test_an_order_statistic_matches_flower_read_back_in_chunks(
    case: str, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    params, reference = ORDER_STATISTICS[case]
    monkeypatch.setattr(readback, "CHUNK", 7)  # many chunks per tensor, one ragged
    global_weights = model(1)
    round_in = contributions(global_weights, count, seed=count)
    round_in[3] = Contribution({n: t + 50.0 for n, t in global_weights.items()}, samples=1000)  # an outlier

    result, state = apiary_round(case.split()[0], params, global_weights, round_in, {})

    assert_matches(result.weights, reference(as_results(round_in)))
    assert state == {}
