"""The strategy set: bad parameters and impossible jobs refused in one line, server state exactly
resumable, adapter rounds honoured by every strategy, order statistics read back from storage."""

from __future__ import annotations

import pytest
import torch

from apiary.strategies.base import Contribution, ContributionList, Strategy, create, known
from apiary.strategies.format import UpdateFormat
from apiary.strategies.validation import InvalidContribution
from apiary.weights import spec_of_tensors

STATEFUL = {"fedavgm": {"server_momentum": 0.9, "server_learning_rate": 0.5}, "fedadam": {}, "fedyogi": {},
            "fedadagrad": {}}
ALL = {**STATEFUL, "fedprox": {"proximal_mu": 0.01}, "fedmedian": {}, "fedtrimmedavg": {},
       "krum": {"num_malicious_nodes": 1}, "multikrum": {"num_nodes_to_keep": 2}, "federated_averaging": {}}
GLOBAL = {"base.weight": torch.linspace(-1.0, 1.0, 12).reshape(3, 4), "lora.a": torch.zeros(4),
          "steps": torch.tensor(5, dtype=torch.int64)}


def round_of(global_weights: dict[str, torch.Tensor], round_number: int, keys: list[str]) -> list[Contribution]:
    gen = torch.Generator().manual_seed(round_number)
    return [Contribution({k: global_weights[k] + torch.randn(global_weights[k].shape, generator=gen)
                          if global_weights[k].is_floating_point() else global_weights[k] + i for k in keys},
                         samples=2 + i) for i in range(5)]


def run_round(strategy: Strategy, global_weights: dict[str, torch.Tensor], contributions: list[Contribution],
              update_format: UpdateFormat = UpdateFormat.FULL) -> dict[str, torch.Tensor]:
    strategy.begin(spec_of_tensors(global_weights), update_format)
    for contribution in contributions:
        strategy.accept(contribution)
    return strategy.finish(global_weights, ContributionList(contributions)).weights


def test_every_strategy_of_the_issue_is_known_by_its_flower_name() -> None:
    assert set(ALL) | {"fedavg"} <= set(known())


@pytest.mark.parametrize(("name", "params", "problem"), [
    ("fedprox", {}, "proximal_mu: Field required"),
    ("fedprox", {"proximal_mu": -0.1}, "proximal_mu: Input should be greater than or equal to 0"),
    ("fedtrimmedavg", {"beta": 0.5}, "beta: Input should be less than 0.5"),
    ("fedadam", {"beta_2": 1.0}, "beta_2: Input should be less than 1"),
    ("fedadagrad", {"beta_1": 0.9}, r"beta_1: Extra inputs .*its parameters: eta, eta_l, tau"),
    ("krum", {"num_malicious_nodes": -1}, "num_malicious_nodes: Input should be greater than or equal to 0"),
    ("fedavgm", {"server_learning_rate": 0}, "server_learning_rate: Input should be greater than 0"),
])
def test_bad_parameters_are_one_line_errors(name: str, params: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as error:
        create(name, params)

    assert "\n" not in str(error.value)


def test_defaults_are_flowers() -> None:
    assert create("fedadam").params.model_dump() == {"eta": 0.1, "eta_l": 0.1, "beta_1": 0.9, "beta_2": 0.99,
                                                     "tau": 1e-9}
    assert create("fedyogi").params.model_dump() == {"eta": 0.01, "eta_l": 0.0316, "beta_1": 0.9, "beta_2": 0.99,
                                                     "tau": 1e-3}
    assert create("fedavgm").params.model_dump() == {"server_learning_rate": 1.0, "server_momentum": 0.0}
    assert create("fedtrimmedavg").params.model_dump() == {"beta": 0.2}
    assert create("multikrum").params.model_dump() == {"num_malicious_nodes": 0, "num_nodes_to_keep": 0}


def test_krum_refuses_a_job_whose_rounds_may_close_with_fewer_than_2f_plus_3() -> None:
    krum = create("krum", {"num_malicious_nodes": 2})

    krum.check_job(num_shards=10, min_workers=7)
    with pytest.raises(ValueError, match=r"needs at least 7 contributions a round .* min_workers=6"):
        krum.check_job(num_shards=10, min_workers=6)
    with pytest.raises(ValueError, match="needs at least 8"):
        create("multikrum", {"num_nodes_to_keep": 8}).check_job(num_shards=10, min_workers=7)
    create("fedtrimmedavg", {"beta": 0.49}).check_job(num_shards=1, min_workers=1)


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_server_state_resumes_exactly_on_a_new_instance(name: str) -> None:
    params, rounds = STATEFUL[name], [round_of(GLOBAL, r, list(GLOBAL)) for r in range(3)]
    undisturbed, weights = create(name, params), dict(GLOBAL)
    for contributions in rounds:
        weights = run_round(undisturbed, weights, contributions)

    resumed, state = dict(GLOBAL), {}
    for contributions in rounds:
        strategy = create(name, params)  # an aggregator restarted between every two rounds
        strategy.load_state(state)
        resumed = run_round(strategy, resumed, contributions)
        state = {key: tensor.clone() for key, tensor in strategy.state().items()}

    assert all(torch.equal(weights[k], resumed[k]) for k in GLOBAL)
    assert int(state["rounds"]) == 3 and not weights["base.weight"].equal(GLOBAL["base.weight"])


def test_a_state_from_another_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"keeps m_t, v_t, got 'momentum\.w'"):
        create("fedadam").load_state({"momentum.w": torch.zeros(1)})


@pytest.mark.parametrize("name", sorted(ALL))
def test_an_adapter_round_changes_only_the_adapter_and_keeps_state_for_it_alone(name: str) -> None:
    strategy = create(name, ALL[name])

    result = run_round(strategy, GLOBAL, round_of(GLOBAL, 1, ["lora.a"]), UpdateFormat.ADAPTER)

    assert strategy.wants_global_weights()
    assert torch.equal(result["base.weight"], GLOBAL["base.weight"]) and torch.equal(result["steps"], GLOBAL["steps"])
    assert not torch.equal(result["lora.a"], GLOBAL["lora.a"])
    assert {key.partition(".")[2] for key in strategy.state() if key != "rounds"} <= {"lora.a"}


@pytest.mark.parametrize("name", ["fedmedian", "fedtrimmedavg", "krum", "multikrum"])
def test_an_order_statistic_needs_its_stored_contributions_and_keeps_only_samples(name: str) -> None:
    strategy, contributions = create(name, ALL[name]), round_of(GLOBAL, 2, list(GLOBAL))
    strategy.begin(spec_of_tensors(GLOBAL), UpdateFormat.FULL)
    for contribution in contributions:
        strategy.accept(contribution)

    with pytest.raises(ValueError, match="pass `stored`"):
        strategy.finish(GLOBAL)
    with pytest.raises(ValueError, match="4 stored contributions for 5 accepted"):
        strategy.finish(GLOBAL, ContributionList(contributions[:4]))
    result = strategy.finish(GLOBAL, ContributionList(contributions))

    assert not strategy.streaming and result.total_samples == sum(c.samples for c in contributions)
    assert result.weights["steps"].dtype == torch.int64


def test_an_order_statistic_refuses_a_non_finite_contribution_without_spoiling_the_round() -> None:
    strategy = create("fedmedian")
    strategy.begin(spec_of_tensors(GLOBAL), UpdateFormat.FULL)
    bad = dict(GLOBAL, **{"lora.a": torch.tensor([0.0, float("inf"), 0.0, 0.0])})

    with pytest.raises(InvalidContribution, match=r"'lora\.a' has NaN or infinite"):
        strategy.accept(Contribution(bad, 1))

    assert strategy.spoiled is None and strategy.total_samples == 0


def test_fedmedian_takes_numpys_median_of_an_even_count() -> None:
    values = [1.0, 9.0, 3.0, 4.0]
    contributions = [Contribution({"w": torch.tensor([v])}, 1) for v in values]

    result = run_round(create("fedmedian"), {"w": torch.zeros(1)}, contributions)

    assert result["w"].item() == 3.5
