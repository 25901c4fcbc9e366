"""FedAvg's average does not depend on the order contributions arrive in (the same bits in every order), and
the float64 sum behind that is used only for models within WIDE_SUM_MAX_BYTES (issue 16's memory bound)."""

from __future__ import annotations

import itertools

import pytest
import torch

from apiary.strategies.base import Contribution, create
from apiary.strategies.fedavg import FedAvg
from apiary.strategies.format import UpdateFormat
from apiary.strategies.weighted_sum import WIDE_SUM_MAX_BYTES, WeightedSum, fits_wide
from apiary.weights import TensorSpec, spec_of_tensors

SAMPLES = [296, 637, 504, 75, 1]


def contributions(dtype: torch.dtype, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Five workers' weights: like one another (a model after a round), with a few values far apart in
    magnitude and sign, where a float32 sum is most sensitive to its order."""
    gen = torch.Generator().manual_seed(seed)
    base = {"conv": torch.randn(32, 1, 3, 3, generator=gen), "fc": torch.randn(10, 512, generator=gen) * 0.05}
    out = []
    for i in range(len(SAMPLES)):
        worker = {k: v + torch.randn(v.shape, generator=gen) * 0.01 for k, v in base.items()}
        worker["fc"][0, : 8] = torch.tensor([1e4, -1e4, 1e-6, -1e-6, 3.0, -3.0, 0.1, -0.1]) * (i + 1)
        out.append({k: v.to(dtype) for k, v in worker.items()})
    return out


def bits(weights: dict[str, torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in weights.values())


def every_order(sums: list[dict[str, torch.Tensor]], wide: bool) -> set[bytes]:
    """The distinct averages over every order of folding `sums`."""
    seen = set()
    for order in itertools.permutations(range(len(sums))):
        acc = WeightedSum(wide=wide)
        for i in order:
            acc.fold(sums[i], SAMPLES[i])
        seen.add(bits(acc.finish()))
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_folding_the_same_contributions_in_any_order_gives_the_same_bits(dtype: torch.dtype) -> None:
    sums = contributions(dtype)

    assert len(every_order(sums, wide=True)) == 1


def test_the_narrow_float32_sum_depends_on_the_order_which_is_why_the_wide_one_exists() -> None:
    assert len(every_order(contributions(torch.float32), wide=False)) > 1


def test_the_wide_average_is_the_exact_mean_rounded_once() -> None:
    sums = contributions(torch.float32, seed=3)
    acc = WeightedSum()
    for weights, samples in zip(sums, SAMPLES, strict=True):
        acc.fold(weights, samples)

    result = acc.finish()

    for name, tensor in result.items():
        exact = torch.stack([n * w[name].double() for n, w in zip(SAMPLES, sums, strict=True)]).sum(0) / sum(SAMPLES)
        assert tensor.dtype == torch.float32 and torch.equal(tensor, exact.float()), name


def test_an_unrounded_mean_for_server_optimisers_comes_in_the_step_dtype() -> None:
    acc = WeightedSum()
    acc.fold({"w": torch.ones(3, dtype=torch.bfloat16), "n": torch.tensor(1)}, 2)

    means = acc.finish(cast=False)

    assert means["w"].dtype == torch.float32 and means["n"].dtype == torch.float64


def test_fedavg_sums_wide_only_within_the_limit() -> None:
    small = spec_of_tensors(contributions(torch.float32)[0])
    limit = WIDE_SUM_MAX_BYTES // 8  # float elements whose float64 accumulator is exactly the limit
    large = {"w": TensorSpec(torch.float32, (limit + 1,))}

    assert fits_wide(small) and fits_wide({"w": TensorSpec(torch.float32, (limit,))}) and not fits_wide(large)
    assert fits_wide({**small, "steps": TensorSpec(torch.int64, (limit,))})  # only float tensors count
    strategy = create("federated_averaging")
    assert isinstance(strategy, FedAvg)
    for spec, accumulator in ((small, torch.float64), (large, torch.float32)):
        strategy.begin(spec, UpdateFormat.FULL)
        strategy.accept(Contribution({name: torch.zeros(t.shape) for name, t in spec.items()}, 3))
        held = strategy._sum._sum  # the accumulator: what the memory bound is about
        assert {t.dtype for t in held.values()} == {accumulator}
