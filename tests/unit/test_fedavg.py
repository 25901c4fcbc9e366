"""FedAvg: the streaming sum equals the hand-computed weighted average; bad contributions never enter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.strategies.base import merge_partial, weighted_metrics
from apiary.strategies.validation import InvalidContribution, all_finite, validate
from apiary.strategies.weighted_sum import WeightedSum as FedAvg  # the streaming sum under the strategy
from apiary.weights import spec_of_tensors

shapes = st.lists(st.integers(min_value=1, max_value=5), min_size=0, max_size=3).map(tuple)


@st.composite
def rounds(draw: st.DrawFn) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    layout = draw(st.lists(shapes, min_size=1, max_size=4))
    k = draw(st.integers(min_value=1, max_value=8))
    seed = draw(st.integers(min_value=0, max_value=2**31))
    gen = torch.Generator().manual_seed(seed)
    contributions = [
        {f"t{i}": torch.randn(shape, generator=gen, dtype=torch.float64) for i, shape in enumerate(layout)}
        for _ in range(k)
    ]
    samples = draw(st.lists(st.integers(min_value=1, max_value=10_000), min_size=k, max_size=k))
    return contributions, samples


@settings(max_examples=60, deadline=None)
@given(rounds(), st.randoms())
def test_streaming_average_equals_weighted_average_in_any_order(data, rnd) -> None:
    contributions, samples = data
    order = list(range(len(samples)))
    rnd.shuffle(order)
    acc = FedAvg()

    for i in order:
        acc.fold(contributions[i], samples[i])
    result = acc.result()

    total = sum(samples)
    for name in contributions[0]:
        expected = sum(n * c[name] for n, c in zip(samples, contributions, strict=True)) / total
        torch.testing.assert_close(result[name], expected, rtol=1e-12, atol=1e-12)
    assert acc.total_samples == total


def test_float32_average_is_exact_for_small_integers() -> None:
    acc = FedAvg()
    acc.fold({"w": torch.full((3,), 1.0)}, 1)
    acc.fold({"w": torch.full((3,), 4.0)}, 2)

    result = acc.result()

    assert result["w"].dtype == torch.float32
    assert torch.equal(result["w"], torch.full((3,), 3.0))


def test_integer_tensors_are_rounded_back_to_their_dtype() -> None:
    acc = FedAvg()
    acc.fold({"n": torch.tensor(3)}, 1)
    acc.fold({"n": torch.tensor(6)}, 1)

    result = acc.result()

    assert result["n"].dtype == torch.int64 and int(result["n"]) == 4  # 4.5 rounds to even


REFERENCE = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}


@pytest.mark.parametrize(
    ("weights", "samples", "reason"),
    [
        ({"a": torch.zeros(2, 3)}, 5, "missing ['b']"),
        ({**REFERENCE, "c": torch.zeros(1)}, 5, "extra ['c']"),
        ({"a": torch.zeros(3, 2), "b": torch.zeros(4)}, 5, "expected float32[2, 3]"),
        ({"a": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(4)}, 5, "float64"),
        ({"a": torch.tensor([[1.0, float("nan"), 0], [0, 0, 0]]), "b": torch.zeros(4)}, 5, "NaN or infinite"),
        ({"a": torch.zeros(2, 3), "b": torch.tensor([0, float("inf"), 0, 0])}, 5, "NaN or infinite"),
        (REFERENCE, 0, "positive"),
        (REFERENCE, -3, "positive"),
        (REFERENCE, True, "positive"),
    ],
)
def test_invalid_contribution_is_rejected_and_leaves_the_sum_unchanged(weights, samples, reason) -> None:
    acc = FedAvg()
    acc.fold({"a": torch.ones(2, 3), "b": torch.ones(4)}, 2)
    before = {k: v.clone() for k, v in acc.result().items()}

    with pytest.raises(InvalidContribution, match=reason.replace("[", r"\[").replace("]", r"\]")):
        validate(spec_of_tensors(REFERENCE), weights, samples)

    after = acc.result()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert acc.count == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_finiteness_is_judged_per_element_even_where_the_sum_overflows(dtype: torch.dtype) -> None:
    huge = torch.finfo(dtype).max
    overflowing = torch.full((1000,), huge, dtype=dtype)  # finite, but its sum is not
    cancelling = torch.tensor([float("inf"), float("-inf")] + [0.0] * 6, dtype=dtype)

    assert all_finite(overflowing) and all_finite(torch.zeros(5, dtype=dtype))
    assert not all_finite(cancelling)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for place in (0, 500, 999):
            tensor = overflowing.clone()
            tensor[place] = bad
            assert not all_finite(tensor), (bad, place)
            tensor = torch.zeros(1000, dtype=dtype)
            tensor[place] = bad
            assert not all_finite(tensor), (bad, place)


def test_partial_contributions_must_share_one_key_set() -> None:
    spec = spec_of_tensors(REFERENCE)

    validate(spec, {"a": torch.zeros(2, 3)}, 1, partial=True)
    with pytest.raises(InvalidContribution, match="adapter tensors differ"):
        validate(spec, {"b": torch.zeros(4)}, 1, partial=True, expected_keys=frozenset({"a"}))


def test_partial_average_is_merged_into_the_base_model() -> None:
    merged = merge_partial({"a": torch.zeros(1), "b": torch.ones(1)}, {"a": torch.full((1,), 5.0)})

    assert merged["a"].item() == 5.0 and merged["b"].item() == 1.0


def test_weighted_metrics_weight_by_samples_and_skip_non_numbers() -> None:
    metrics = weighted_metrics([(1, {"loss": 1.0, "tag": "x"}), (3, {"loss": 3.0})])  # type: ignore[dict-item]

    assert metrics == {"loss": pytest.approx(2.5)}


def test_result_without_contributions_is_an_error() -> None:
    with pytest.raises(ValueError, match="nothing to average"):
        FedAvg().result()


def test_finish_averages_in_place_and_closes_the_sum() -> None:
    acc = FedAvg()
    acc.fold({"w": torch.full((2,), 2.0), "n": torch.tensor(1)}, 1)
    acc.fold({"w": torch.full((2,), 5.0), "n": torch.tensor(4)}, 2)
    expected = acc.result()

    finished = acc.finish()

    assert torch.equal(finished["w"], expected["w"]) and torch.equal(finished["n"], expected["n"])
    with pytest.raises(ValueError, match="finished"):
        acc.fold({"w": torch.zeros(2), "n": torch.tensor(0)}, 1)


def test_fold_checks_values_and_a_refused_first_contribution_leaves_an_empty_sum() -> None:
    acc = FedAvg()

    with pytest.raises(InvalidContribution, match="'b' has NaN or infinite values"):
        acc.fold({"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")])}, 3)
    acc.fold({"a": torch.full((2,), 2.0), "b": torch.full((2,), 4.0)}, 1)

    assert not acc.spoiled and acc.count == 1 and acc.total_samples == 1
    assert torch.equal(acc.result()["a"], torch.full((2,), 2.0))


def test_a_value_refused_before_anything_was_added_leaves_the_sum_exact() -> None:
    acc = FedAvg()
    acc.fold({"a": torch.full((2,), 1.0), "b": torch.full((2,), 3.0)}, 1)

    with pytest.raises(InvalidContribution, match="'a'"):
        acc.fold({"a": torch.tensor([float("inf"), 0.0]), "b": torch.ones(2)}, 5)
    acc.fold({"a": torch.full((2,), 4.0), "b": torch.full((2,), 6.0)}, 2)

    assert not acc.spoiled
    assert torch.equal(acc.result()["a"], torch.full((2,), 3.0)) and acc.total_samples == 3


def test_a_value_refused_after_part_was_added_spoils_the_sum_until_rebuilt() -> None:
    acc = FedAvg()
    acc.fold({"a": torch.ones(2), "b": torch.ones(2)}, 1)

    with pytest.raises(InvalidContribution, match="'b' has NaN"):
        acc.fold({"a": torch.ones(2), "b": torch.tensor([float("nan"), 0.0])}, 5)

    assert acc.spoiled and "'b' has NaN" in acc.spoiled
    for use in (lambda: acc.fold({"a": torch.ones(2), "b": torch.ones(2)}, 1), acc.result, acc.finish):
        with pytest.raises(ValueError, match="spoiled"):
            use()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.bool])
def test_the_first_contribution_starts_the_sum_in_the_accumulating_dtype(dtype: torch.dtype) -> None:
    acc = FedAvg()
    acc.fold({"w": torch.tensor([1, 0, 1], dtype=dtype)}, 3)
    acc.fold({"w": torch.tensor([1, 1, 0], dtype=dtype)}, 1)

    result = acc.result()["w"]

    assert result.dtype == dtype
    expected = torch.tensor([1.0, 0.25, 0.75])
    if dtype == torch.bool:
        assert torch.equal(result, expected >= 0.5)
    elif dtype.is_floating_point:
        assert torch.equal(result, expected.to(dtype))
    else:
        assert torch.equal(result, torch.round(expected).to(dtype))
