"""The unmasked mean update as the round's one contribution to its strategy (on the aggregator).

A weighted-sum strategy (FedAvg, FedProx, FedAvgM, the FedOpt family) reads a round only through the
sample-weighted mean of its contributions; given the single contribution `global + mean update` carrying the
round's total samples, it makes of it what it makes of the round: FedAvg returns it, FedAvgM and FedOpt step from
the global weights towards it. Differential privacy clipped on workers wraps that strategy unchanged: the mean of
updates clipped to C is within C (the norm is convex), and the wrapper's noise goes on that mean.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from apiary.strategies.base import Contribution


def contribution_of_mean(mean_update: np.ndarray, global_weights: Mapping[str, torch.Tensor], total_samples: int,
                         metrics: Mapping[str, float] | None = None) -> Contribution:
    """`global_weights + mean_update` (the vector in sorted name order) in each tensor's dtype, integers rounded;
    one contribution of `total_samples` samples."""
    weights: dict[str, torch.Tensor] = {}
    offset = 0
    for name in sorted(global_weights):
        base = global_weights[name]
        size = base.numel()
        if offset + size > mean_update.size:
            raise ValueError(f"the unmasked vector has {mean_update.size} values, fewer than the round's tensors")
        update = torch.from_numpy(np.ascontiguousarray(mean_update[offset:offset + size])).reshape(base.shape)
        value = base.double() + update
        weights[name] = value.to(base.dtype) if base.is_floating_point() else value.round().to(base.dtype)
        offset += size
    if offset != mean_update.size:
        raise ValueError(f"the unmasked vector has {mean_update.size} values, the round's tensors {offset}")
    return Contribution(weights, total_samples, dict(metrics or {}))
