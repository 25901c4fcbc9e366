"""A trained result clipped on the worker before upload (differential privacy with `clip_on: worker`): the
aggregator never holds an unclipped update, and refuses one that measures over the norm. With `noise_on: worker`
the worker adds its share of the Gaussian noise to the clipped update too (drawn in float64, rounded once to each
tensor's dtype), so that the aggregator never holds an un-noised one either."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from apiary import weights as w
from apiary.strategies.clipping import clip_for_upload
from apiary.strategies.private import seeded


def clip_result(result_path: str | Path, weights_path: str | Path, norm_bound: float, *, noise_std: float = 0.0,
                noise_seed: int | None = None) -> tuple[int, str]:
    """Rewrite the result at `result_path` with its update (against the round's global weights at `weights_path`)
    clipped to `norm_bound`, and Gaussian noise of std `noise_std` added to each floating tensor (from the OS's
    entropy, or, in tests only, `noise_seed`); its new size and sha256. ValueError (one line) if the two do not
    match."""
    result = w.loads(Path(result_path).read_bytes())
    base = w.loads(Path(weights_path).read_bytes())
    for name, tensor in result.items():
        reference = base.get(name)
        if reference is None:
            raise ValueError(f"tensor {name!r} is not in the round's global weights")
        if reference.shape != tensor.shape or reference.dtype != tensor.dtype:
            raise ValueError(f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, the global weights' "
                             f"{reference.dtype} {tuple(reference.shape)}")
    clipped, _ = clip_for_upload(result, base, norm_bound)
    if noise_std > 0:
        clipped = noised(clipped, noise_std, noise_seed)
    data = w.dumps(clipped)
    part = Path(f"{result_path}.part")
    part.write_bytes(data)
    part.replace(result_path)
    return len(data), hashlib.sha256(data).hexdigest()


def noised(weights: dict[str, torch.Tensor], std: float, seed: int | None) -> dict[str, torch.Tensor]:
    """`weights` with Gaussian noise of `std` added to every floating tensor, in float64 and rounded once to the
    tensor's dtype. Seeded, each tensor's noise has a generator of its own (whatever order the tensors come in)."""
    shared = seeded(None, 0) if seed is None else None
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if not tensor.is_floating_point():
            out[name] = tensor
            continue
        rng = shared if shared is not None else seeded(seed, 0, name)
        noise = torch.from_numpy(rng.normal(0.0, std, tuple(tensor.shape)))
        out[name] = tensor.double().add_(noise).to(tensor.dtype)
    return out
