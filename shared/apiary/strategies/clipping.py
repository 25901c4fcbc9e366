"""Clipping an update to an L2 norm: what the privacy wrapper does on the aggregator and a worker does before upload.

An update is a contribution less the round's global weights, over the tensors the contribution carries (the
adapter's alone in a LoRA job) and their float tensors only (an integer counter is not a direction). Its norm
is one L2 norm over all of them, summed in float64. Clipping scales it by `min(1, norm_bound / norm)` (FlatClip of
McMahan et al. 2018, as Flower's `clip_inputs_inplace`) and adds it back to the global weights, in the
contribution's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

# A worker aims this far below the bound, so that the aggregator, recomputing the norm from the float32 weights
# it stores, never finds it over (the rounding of `global + update` moves the norm by far less).
WORKER_MARGIN = 1e-6
# How far over the bound an update a worker clipped may measure at the aggregator (summation order, float64).
VERIFY_TOLERANCE = 1e-9


def update_norm(weights: Mapping[str, torch.Tensor], global_weights: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of `weights - global_weights` over the float tensors `weights` carries, in float64."""
    total = 0.0
    for name, tensor in weights.items():
        if tensor.is_floating_point():
            update = tensor.double() - global_weights[name].double()
            total += float(torch.dot(update.flatten(), update.flatten()))
    return total ** 0.5


def clipped(weights: Mapping[str, torch.Tensor], global_weights: Mapping[str, torch.Tensor], norm_bound: float,
            norm: float | None = None) -> dict[str, torch.Tensor]:
    """The contribution whose update is clipped to `norm_bound` (itself where it is within it); `norm` is the
    update's, where already known."""
    norm = update_norm(weights, global_weights) if norm is None else norm
    if norm <= norm_bound:
        return dict(weights)
    scale = norm_bound / norm
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if not tensor.is_floating_point():
            out[name] = tensor
            continue
        base = global_weights[name]
        # In the tensor's dtype, as Flower does (numpy: float32 update times the scale as float32).
        out[name] = torch.sub(tensor, base).mul_(scale).add_(base)
    return out


def clip_for_upload(weights: Mapping[str, torch.Tensor], global_weights: Mapping[str, torch.Tensor],
                    norm_bound: float) -> tuple[dict[str, torch.Tensor], bool]:
    """A worker's contribution clipped so that the aggregator measures its update within `norm_bound` (a hair
    inside it: WORKER_MARGIN), and whether it was within the bound already (unclipped)."""
    norm = update_norm(weights, global_weights)
    if norm <= norm_bound:
        return dict(weights), True
    target = norm_bound * (1 - WORKER_MARGIN)
    out = clipped(weights, global_weights, target, norm)
    for _ in range(8):  # float rounding of `global + update` may leave it over: scale a little more
        measured = update_norm(out, global_weights)
        if measured <= norm_bound:
            break
        target *= norm_bound / measured * (1 - WORKER_MARGIN)
        out = clipped(weights, global_weights, target, norm)
    return out, False


def over_bound(norm: float, norm_bound: float) -> bool:
    """Whether an update a worker says it clipped measures over the bound at the aggregator."""
    return norm > norm_bound * (1 + VERIFY_TOLERANCE)


def noised_bound(norm_bound: float, std: float, size: int) -> float:
    """The most an update clipped to `norm_bound` and then noised (Gaussian, `std` per value, `size` values)
    measures, but for odds below 1e-9: its squared norm is `|u|^2 + 2 u.e + |e|^2`, with `|e|^2` of mean
    `std^2 size` and std `std^2 sqrt(2 size)`, and `2 u.e` of std at most `2 std norm_bound`; six of each std on
    top. The noise hides a smaller excess: this catches an update left unclipped far over the norm, not every
    dishonest worker."""
    squared = (norm_bound ** 2 + std ** 2 * (size + 6 * math.sqrt(2 * size)) + 12 * std * norm_bound)
    return math.sqrt(squared) * (1 + VERIFY_TOLERANCE)


def float_size(weights: Mapping[str, torch.Tensor]) -> int:
    """How many values the update of `weights` has (their float tensors')."""
    return sum(t.numel() for t in weights.values() if t.is_floating_point())
