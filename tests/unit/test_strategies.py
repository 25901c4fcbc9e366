"""The strategy seam: strategies found by name, parameters checked, the update format honoured."""

from __future__ import annotations

import msgpack
import pytest
import torch

from apiary.contracts import RoundStart, decode, encode
from apiary.strategies.base import Contribution, Strategy, create, known, lookup
from apiary.strategies.fedavg import FedAvg
from apiary.strategies.format import UpdateFormat
from apiary.strategies.validation import InvalidContribution
from apiary.weights import spec_of_tensors

GLOBAL = {"base": torch.full((2,), 7.0), "lora": torch.zeros(2)}


def test_fedavg_is_the_default_and_found_by_its_alias() -> None:
    assert lookup("federated_averaging") is FedAvg and lookup("fedavg") is FedAvg
    assert isinstance(create(), FedAvg)
    assert {"federated_averaging", "fedavg"} <= set(known())


def test_unknown_names_and_parameters_are_rejected_with_what_is_known() -> None:
    with pytest.raises(ValueError, match=r"unknown strategy 'fedmystery'; known: .*federated_averaging"):
        create("fedmystery")
    with pytest.raises(ValueError, match=r"strategy 'fedavg': .*server_momentum.*its parameters: none"):
        create("fedavg", {"server_momentum": 0.9})


def test_a_full_round_is_the_weighted_average_with_weighted_metrics() -> None:
    strategy = create("fedavg")
    strategy.begin(spec_of_tensors(GLOBAL), UpdateFormat.FULL)

    strategy.accept(Contribution({"base": torch.full((2,), 1.0), "lora": torch.ones(2)}, 1, {"loss": 4.0}))
    strategy.accept(Contribution({"base": torch.full((2,), 4.0), "lora": torch.ones(2)}, 2, {"loss": 1.0}))
    result = strategy.finish()

    assert not strategy.wants_global_weights()
    assert torch.equal(result.weights["base"], torch.full((2,), 3.0))
    assert result.total_samples == 3 and result.metrics == {"loss": pytest.approx(2.0)}


def test_an_adapter_round_averages_the_adapter_and_keeps_the_rest_of_the_global_model() -> None:
    strategy = create("federated_averaging")
    strategy.begin(spec_of_tensors(GLOBAL), UpdateFormat.ADAPTER)
    strategy.accept(Contribution({"lora": torch.full((2,), 2.0)}, 1))
    strategy.accept(Contribution({"lora": torch.full((2,), 5.0)}, 2))

    assert strategy.wants_global_weights()
    result = strategy.finish(GLOBAL)

    assert torch.equal(result.weights["lora"], torch.full((2,), 4.0))
    assert torch.equal(result.weights["base"], GLOBAL["base"])


def test_a_full_round_refuses_a_partial_contribution_and_an_adapter_round_a_changed_key_set() -> None:
    full, adapter = create(), create()
    full.begin(spec_of_tensors(GLOBAL), UpdateFormat.FULL)
    adapter.begin(spec_of_tensors(GLOBAL), UpdateFormat.ADAPTER)
    adapter.accept(Contribution({"lora": torch.ones(2)}, 1))

    with pytest.raises(InvalidContribution, match=r"missing \['base'\]"):
        full.accept(Contribution({"lora": torch.ones(2)}, 1))
    with pytest.raises(InvalidContribution, match="adapter tensors differ"):
        adapter.accept(Contribution({"base": torch.ones(2)}, 1))
    assert adapter.total_samples == 1


def test_a_refusal_after_part_was_taken_in_spoils_the_round() -> None:
    strategy = create()
    strategy.begin(spec_of_tensors(GLOBAL), UpdateFormat.FULL)
    strategy.accept(Contribution({"base": torch.ones(2), "lora": torch.ones(2)}, 1))

    with pytest.raises(InvalidContribution, match="'lora' has NaN"):
        strategy.accept(Contribution({"base": torch.ones(2), "lora": torch.tensor([float("nan"), 0.0])}, 1))

    assert strategy.spoiled and strategy.total_samples == 1


def test_fedavg_keeps_no_server_state() -> None:
    strategy = create()

    assert strategy.state() == {}
    strategy.load_state({})
    with pytest.raises(ValueError, match="keeps no server state"):
        strategy.load_state({"momentum": torch.zeros(1)})


def test_a_strategy_says_only_how_it_folds_and_aggregates() -> None:
    class Last(Strategy):
        name = "last_for_test"

        def _begin(self) -> None:
            self.last: dict[str, torch.Tensor] = {}

        def _fold(self, contribution: Contribution) -> None:
            self.last = dict(contribution.weights)

        def _aggregate(self, global_weights: object) -> dict[str, torch.Tensor]:
            return self.last

    strategy = Last()
    strategy.begin(spec_of_tensors(GLOBAL), UpdateFormat.ADAPTER)
    strategy.accept(Contribution({"lora": torch.full((2,), 9.0)}, 3, {"acc": 0.5}))

    result = strategy.finish(GLOBAL)

    assert torch.equal(result.weights["lora"], torch.full((2,), 9.0)) and "base" in result.weights
    assert result.metrics == {"acc": 0.5} and result.total_samples == 3


def test_a_round_start_from_before_update_format_still_decodes_its_use_peft() -> None:
    old = {"job_id": "j", "round": 1, "num_rounds": 2, "shards": [0], "min_workers": 1, "deadline": 1.0,
           "weights": {"key": "k", "size": 1, "sha256": "s"}, "use_peft": True}

    event = decode("round.start", msgpack.packb(old))

    assert isinstance(event, RoundStart)
    assert event.update_format is UpdateFormat.ADAPTER and event.strategy == "federated_averaging"
    assert decode("round.start", encode(event)) == event
