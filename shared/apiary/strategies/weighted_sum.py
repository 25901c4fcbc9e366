"""The streaming weighted sum under FedAvg (and the strategies built on its mean).

Memory is one accumulator plus the contribution being folded, whatever the number of workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

import torch

from apiary.strategies.validation import InvalidContribution, all_finite


class WeightedSum:
    """A streaming weighted sum: fold contributions as they arrive, read the average at the end."""

    def __init__(self) -> None:
        self._sum: dict[str, torch.Tensor] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self.total_samples = 0
        self.count = 0
        self.spoiled: str | None = None  # why the sum can no longer be used, if it cannot

    def fold(self, weights: Mapping[str, torch.Tensor], samples: int) -> None:
        """Add `samples * weights` to the running sum (names, shapes and dtypes must be validated first).

        Each float tensor is checked for NaN and infinities just before it is added, while it is in
        cache: a contribution is read from memory once. A bad tensor raises InvalidContribution after
        the tensors before it were added; the first contribution is then undone (the sum starts
        empty again), a later one spoils the sum (`spoiled` says why; fold and finish refuse it): an
        exact sum must be rebuilt from the contributions accepted so far (subtracting the added
        tensors back would not give the same bits).
        """
        if samples <= 0:
            raise InvalidContribution(f"sample count must be positive, got {samples}")
        self._usable()
        if self._sum and weights.keys() != self._sum.keys():
            raise InvalidContribution("contribution's tensor names differ from the accumulated ones")
        for added, (name, tensor) in enumerate(weights.items()):
            if not all_finite(tensor):
                self._refuse(name, added)
            acc = self._sum.get(name)
            if acc is None:
                self._sum[name] = self._start(name, tensor, samples)
            elif tensor.dtype == acc.dtype:
                acc.add_(tensor, alpha=samples)
            else:
                acc.add_(tensor.to(acc.dtype), alpha=samples)
        self.total_samples += samples
        self.count += 1

    def _refuse(self, name: str, added: int) -> NoReturn:
        error = InvalidContribution(f"tensor {name!r} has NaN or infinite values")
        if self.count and added:
            self.spoiled = f"a contribution was refused after part of it was added ({error})"
        elif not self.count:  # the refused contribution was the sum's first: start empty again
            self._sum.clear()
            self._dtypes.clear()
        raise error

    def _start(self, name: str, tensor: torch.Tensor, samples: int) -> torch.Tensor:
        # The first contribution starts the sum (no zeroed accumulator to read). Floats accumulate
        # in their own precision (memory: one model), half floats in float32, integers in float64.
        self._dtypes[name] = tensor.dtype
        acc_dtype = tensor.dtype if tensor.is_floating_point() else torch.float64
        if tensor.dtype in (torch.float16, torch.bfloat16):
            acc_dtype = torch.float32
        start = tensor.to(acc_dtype)
        return torch.mul(tensor, samples) if start is tensor else start.mul_(samples)

    def _usable(self) -> None:
        if self.count < 0:
            raise ValueError("this average is finished: start a new sum")
        if self.spoiled:
            raise ValueError(f"this sum is spoiled: {self.spoiled}; rebuild it from the accepted contributions")

    def finish(self, cast: bool = True) -> dict[str, torch.Tensor]:
        """The weighted average, computed in place in the accumulator (no second model in memory);
        the accumulator cannot be folded into afterwards.

        With `cast=False` each mean stays in its accumulator's precision (`as_dtype` with `dtypes`
        casts it back later), for strategies that compute further on it.
        """
        self._readable()
        out = {name: acc.div_(self.total_samples) for name, acc in self._sum.items()}
        if cast:
            out = {name: as_dtype(mean, self._dtypes[name]) for name, mean in out.items()}
        self._sum = {}
        self.count = -1
        return out

    def result(self) -> dict[str, torch.Tensor]:
        """The weighted average, in each tensor's original dtype."""
        self._readable()
        return {name: as_dtype(acc / self.total_samples, self._dtypes[name]) for name, acc in self._sum.items()}

    @property
    def dtypes(self) -> dict[str, torch.dtype]:
        """Each folded tensor's original dtype."""
        return dict(self._dtypes)

    def _readable(self) -> None:
        self._usable()
        if not self.count:
            raise ValueError("no contribution was folded: nothing to average")


def as_dtype(mean: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mean back in its tensor's dtype: floats cast, booleans by majority, integers rounded."""
    if dtype.is_floating_point:
        return mean.to(dtype)
    if dtype == torch.bool:
        return mean >= 0.5
    return torch.round(mean).to(dtype)
