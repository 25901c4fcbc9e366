"""Whether a contribution may enter a round: names, shapes, dtypes, sample count and finite values."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from apiary.weights import TensorSpec, WeightSpec


class InvalidContribution(ValueError):
    """A contribution that must not enter the average; the message says why."""


def validate(
    reference: WeightSpec,
    weights: Mapping[str, torch.Tensor],
    samples: int,
    *,
    partial: bool = False,
    expected_keys: frozenset[str] | None = None,
    values: bool = True,
) -> None:
    """Check keys, shapes, dtypes, finiteness and sample count against the global model's spec.

    With `partial` (adapter updates) the keys may be a subset of the model's, but every contribution
    of a round must carry the same set (`expected_keys`, fixed by the first one accepted).
    `values=False` leaves finiteness to the fold, which checks each tensor while it is in cache
    (one read of the contribution instead of two).
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples <= 0:
        raise InvalidContribution(f"sample count must be a positive integer, got {samples!r}")
    names = frozenset(weights)
    if not names:
        raise InvalidContribution("contribution has no tensors")
    if partial:
        _check_partial_names(reference, names, expected_keys)
    else:
        missing, extra = reference.keys() - names, names - reference.keys()
        if missing or extra:
            raise InvalidContribution(f"tensor names differ: missing {_few(missing)}, extra {_few(extra)}")
    # Weights streamed from storage declare their spec (their header), so checking it reads no tensor.
    declared: WeightSpec | None = getattr(weights, "declared_spec", None)
    for name in sorted(names):
        want = reference[name]
        if declared is not None and not values:
            got = declared[name]
        else:
            tensor = weights[name]
            got = TensorSpec(tensor.dtype, tuple(tensor.shape))
        if got != want:
            raise InvalidContribution(f"tensor {name!r} is {got.describe()}, expected {want.describe()}")
        if values and not all_finite(weights[name]):
            raise InvalidContribution(f"tensor {name!r} has NaN or infinite values")


def _check_partial_names(reference: WeightSpec, names: frozenset[str], expected: frozenset[str] | None) -> None:
    extra = names - reference.keys()
    if extra:
        raise InvalidContribution(f"unknown tensors {_few(extra)}")
    if expected is not None and names != expected:
        raise InvalidContribution(
            f"adapter tensors differ from the round's: missing {_few(expected - names)}, "
            f"extra {_few(names - expected)}"
        )


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of a float tensor is finite, at about the cost of reading it once.

    A NaN or an infinity makes the sum NaN or infinite, so a finite sum proves every element finite
    (the sum runs in the tensor's own dtype: a float64 sum of float32 is ~15x slower on CPU). A sum that
    is not finite may only have overflowed: the extremes then decide (NaN propagates through them).
    Non-float tensors are always finite.
    """
    if not tensor.is_floating_point() or not tensor.numel():
        return True
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor.amax())) and bool(torch.isfinite(tensor.amin()))


def _few(names: frozenset[str] | set[str]) -> str:
    items = sorted(names)
    shown = ", ".join(repr(n) for n in items[:3])
    return f"[{shown}{', …' if len(items) > 3 else ''}]" if items else "[]"
