"""Fixed point for the ring: a weighted update's values, clipped to [-c, c], map to integers in [0, Q] by
stochastic rounding (Flower 1.42's `quantize`: unbiased, each value off by less than one step 2c/Q).

The error bound: K contributions each off by less than one step per value sum to less than K steps off; the
aggregator divides the dequantised sum of `(n_i / max_weight) * update_i` by `sum(n_i) / max_weight`, so the
weighted mean is off by less than `K * (2c / Q) * max_weight / sum(n_i)` per value (`mean_error_bound`), as long
as no weighted value was clipped (|n_i / max_weight * update| <= c).
"""

from __future__ import annotations

import numpy as np


def step(clipping_range: float, quantization_range: int) -> float:
    """One quantisation step: the value between two neighbouring integers."""
    return 2.0 * clipping_range / quantization_range


def quantize(values: np.ndarray, clipping_range: float, quantization_range: int,
             rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """`values` (float) clipped to [-c, c] and stochastically rounded onto [0, Q] (uint64), and how many were
    clipped."""
    x = np.asarray(values, dtype=np.float64)
    clipped = int(np.count_nonzero(np.abs(x) > clipping_range))
    per_step = quantization_range / (2.0 * clipping_range)
    scaled = (np.clip(x, -clipping_range, clipping_range) + clipping_range) * per_step
    low = np.floor(scaled)
    up = rng.random(scaled.shape) < (scaled - low)  # rounds up with the fraction's probability: unbiased
    q = (low + up).clip(0, quantization_range)
    return q.astype(np.uint64), clipped


def dequantize_sum(total: np.ndarray, contributors: int, clipping_range: float, quantization_range: int) -> np.ndarray:
    """The float sum of `contributors` values from the sum of their quantised forms (each carried an offset c)."""
    return total.astype(np.float64) * step(clipping_range, quantization_range) - contributors * clipping_range


def mean_error_bound(contributors: int, total_samples: int, clipping_range: float, quantization_range: int,
                     max_weight: float) -> float:
    """The most the unmasked weighted mean differs from the plain one, per value (module docstring)."""
    return contributors * step(clipping_range, quantization_range) * max_weight / total_samples
