"""An open round's state in memory: sound while it is exactly what its rows say, stale when a change of it stopped
part way (it is then recovered from the rows)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from apiary.contracts import ObjectRef
from apiary.status import ContributionStatus
from apiary.strategies import DEFAULT_STRATEGY
from apiary.strategies.base import Contribution, create
from apiary.strategies.format import UpdateFormat
from apiary.strategies.validation import InvalidContribution
from apiary.weights import spec_of_tensors
from services.aggregator.round_state import Round, RoundState


def _state() -> RoundState:
    round_ = Round(key=("j", 1, 1), shards=frozenset({0, 1, 2}), min_workers=1,
                   weights=ObjectRef(key="w", size=1, sha256="0"), deadline=0.0, traceparent=None,
                   strategy=DEFAULT_STRATEGY, strategy_params={}, update_format=UpdateFormat.FULL, secret_digests="{}")
    strategy = create(DEFAULT_STRATEGY)
    strategy.begin(spec_of_tensors({"a": torch.zeros(2), "b": torch.zeros(2)}), UpdateFormat.FULL)
    return RoundState(round=round_, strategy=strategy)


def _contribution(*values: float) -> Contribution:
    """Tensors a and b of four values (the first two in a), added to a sum in that order."""
    a, b = torch.tensor(values[:2], dtype=torch.float32), torch.tensor(values[2:], dtype=torch.float32)
    return Contribution({"a": a, "b": b}, samples=2, metrics={})


def test_a_row_reads_as_the_round_its_round_start_stored() -> None:
    row = {"job_id": "j", "round": 2, "attempt": 1, "shards": "[0,1]", "min_workers": 1, "weights_key": "k",
           "weights_size": 3, "weights_sha256": "s", "deadline": 12.5, "traceparent": None,
           "strategy": "fedavgm", "strategy_params": '{"server_momentum": 0.9}', "update_format": "full",
           "secret_digests": '{"0": "d0", "1": "d1"}'}

    round_ = Round.of(row)

    assert (round_.key, round_.shards, round_.deadline, round_.strategy, dict(round_.strategy_params),
            round_.update_format, round_.digests_row) == (
        ("j", 2, 1), frozenset({0, 1}), 12.5, "fedavgm", {"server_momentum": 0.9}, UpdateFormat.FULL,
        {"secret_digests": '{"0": "d0", "1": "d1"}'})


def test_a_contribution_taken_in_or_refused_whole_leaves_the_state_sound() -> None:
    state = _state()

    state.take_in(0, _contribution(1, 2, 3, 4))
    with pytest.raises(InvalidContribution):
        state.take_in(1, _contribution(1, 2, 3))  # b of the wrong shape: refused before anything is added

    assert state.sound
    assert state.settled == {0: ContributionStatus.ACCEPTED}


def test_a_refusal_that_spoiled_the_sum_leaves_the_state_unsound() -> None:
    state = _state()
    state.take_in(0, _contribution(1, 2, 3, 4))

    with pytest.raises(InvalidContribution):
        state.take_in(1, _contribution(1, 1, float("nan"), 1))  # a was added before b's NaN was found

    assert not state.sound


def test_a_fold_stopped_by_another_error_leaves_the_state_stale() -> None:
    state = _state()

    def broken(contribution: Contribution) -> None:
        raise MemoryError("out of memory half way")

    state.strategy.accept = broken
    with pytest.raises(MemoryError):
        state.take_in(0, _contribution(1, 2, 3, 4))

    assert not state.sound
    assert state.settled == {}


def test_a_shard_settles_once_its_row_is_stored_and_a_write_that_fails_leaves_the_state_stale() -> None:
    async def stored() -> int:
        return 1

    async def failed() -> int:
        raise ConnectionError("the database went away")

    state = _state()
    assert asyncio.run(state.settle(0, ContributionStatus.FAILED, stored())) == 1
    assert state.sound and state.settled == {0: ContributionStatus.FAILED}

    with pytest.raises(ConnectionError):
        asyncio.run(state.settle(1, ContributionStatus.REJECTED, failed()))
    assert not state.sound
    assert state.settled == {0: ContributionStatus.FAILED}
