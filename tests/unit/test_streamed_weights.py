"""Contributions folded straight from storage: read in ranges, chunk by chunk, into the same sum as whole tensors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from apiary import streamed_weights
from apiary.backoff import Backoff, poll
from apiary.strategies.base import Contribution, create
from apiary.strategies.format import UpdateFormat
from apiary.strategies.validation import InvalidContribution
from apiary.streamed_weights import RangeSource, StreamedWeights
from apiary.weights import WeightsError, dumps, spec_of_tensors


def _stored(tmp_path: Path, name: str, weights: dict[str, torch.Tensor]) -> StreamedWeights:
    data = dumps(weights)
    path = tmp_path / name
    path.write_bytes(data)
    return StreamedWeights(RangeSource(path.as_uri()), len(data), hashlib.sha256(data).hexdigest(), window=4096)


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Odd sizes and mixed dtypes: elements straddle the reads' boundaries.
    return {"h": torch.randn(1001, generator=g).half(), "w": torch.randn(37, 29, generator=g),
            "empty": torch.empty(0, 3), "d": torch.randn(7, generator=g).double(),
            "n": torch.tensor(seed, dtype=torch.int64)}


@pytest.fixture(autouse=True)
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamed_weights, "READ", 999)


def test_a_streamed_object_reads_back_as_its_tensors(tmp_path: Path) -> None:
    weights = _model(1)

    stored = _stored(tmp_path, "a", weights)

    assert stored.declared_spec == spec_of_tensors(weights)
    assert {n: t.tolist() for n, t in stored.items()} == {n: t.tolist() for n, t in weights.items()}
    assert torch.equal(stored["w"], weights["w"])


@pytest.mark.parametrize("strategy", ["federated_averaging", "fedadam", "fedavgm"])
def test_folding_chunks_from_storage_gives_the_same_bits_as_whole_tensors(tmp_path: Path, strategy: str) -> None:
    models = [_model(seed) for seed in (1, 2, 3)]
    base = _model(0)
    results = []
    for streamed in (False, True):
        s = create(strategy)
        s.begin(spec_of_tensors(base), UpdateFormat.FULL, base)
        for i, m in enumerate(models):
            weights = _stored(tmp_path, f"{streamed}-{i}", m) if streamed else m
            s.accept(Contribution(weights, 3 + i))
        results.append(s.finish(base).weights)

    whole, chunked = results
    assert all(torch.equal(whole[n], chunked[n]) for n in whole)


def test_a_changed_object_is_refused_before_its_last_chunk_is_added(tmp_path: Path) -> None:
    path = tmp_path / "x"
    data = dumps(_model(4))
    path.write_bytes(data)
    stored = StreamedWeights(RangeSource(path.as_uri()), len(data), "0" * 64)
    s = create("federated_averaging")
    s.begin(spec_of_tensors(_model(4)), UpdateFormat.FULL)

    with pytest.raises(WeightsError, match="sha256 mismatch"):
        s.accept(Contribution(stored, 1))


def test_a_non_finite_chunk_after_others_spoils_the_sum_as_a_whole_tensor_would(tmp_path: Path) -> None:
    s = create("federated_averaging")
    s.begin(spec_of_tensors(_model(1)), UpdateFormat.FULL)
    s.accept(Contribution(_stored(tmp_path, "a", _model(1)), 1))
    bad = _model(2)
    bad["w"][-1, -1] = float("nan")

    with pytest.raises(InvalidContribution, match="NaN"):
        s.accept(Contribution(_stored(tmp_path, "b", bad), 1))

    assert s.spoiled is not None


async def test_a_streamed_fold_cancelled_part_way_leaves_the_round_to_be_recovered(tmp_path: Path) -> None:
    import asyncio

    from services.aggregator.round_state import Round, RoundState
    from services.aggregator.wire_decode import take_in

    strategy = create("federated_averaging")
    strategy.begin(spec_of_tensors(_model(1)), UpdateFormat.FULL)
    round_ = Round(key=("j", 1, 1), shards=frozenset({0}), min_workers=1, weights=None,  # type: ignore[arg-type]
                   deadline=0.0, traceparent=None, strategy="federated_averaging", strategy_params={},
                   update_format=UpdateFormat.FULL, secret_digests="{}")
    state = RoundState(round=round_, strategy=strategy)
    folding = asyncio.ensure_future(take_in(state, 0, Contribution(_stored(tmp_path, "a", _model(1)), 1)))
    await asyncio.sleep(0)

    folding.cancel()
    with pytest.raises(asyncio.CancelledError):
        await folding
    async def folded() -> bool:  # the thread's fold ends on its own
        return 0 in state.settled

    assert await poll(folded, Backoff(base=0.01, cap=0.1), 30)  # folded, but its row was never recorded
    assert not state.sound
