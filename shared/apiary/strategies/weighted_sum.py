"""The streaming weighted sum under FedAvg (and the strategies built on its mean).

Memory is one accumulator plus the contribution being folded, whatever the number of workers.

Contributions are folded in the order they arrive, and float addition is not associative: summed in
float32, the same contributions give different last bits depending on which worker finished first, and
after a few rounds a prediction or two. So float tensors accumulate in float64 (`wide`): a float32 (or
half) value times an integer sample count below 2**29 is exact in float64, the few additions of a
round lose bits only where contributions differ by more than ~2**15 in magnitude, and the mean is
rounded once, at the end, to its dtype; the result is the same bits in any order (tests/unit/
test_fedavg.py folds every order). The float64 accumulator is 2x a float32 model (4x a half one):
FedAvg uses it while it stays within WIDE_SUM_MAX_BYTES, and larger models (LoRA adapters of issue 16,
whose aggregator holds at most 2x the adapter) keep the accumulator in their own precision (float32
for half floats), where the order of arrival shows in the last bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import NoReturn

import torch

from apiary.strategies.validation import InvalidContribution, all_finite
from apiary.weights import WeightSpec

# The largest float64 accumulator (bytes) FedAvg sums a model in: 4 Mi float elements (a float32 model up
# to 16 MiB). The digits CNN needs 120 KiB; issue 16's benchmark adapter (28 MiB float32) stays narrow.
WIDE_SUM_MAX_BYTES = 32 * 2**20
_HALF = (torch.float16, torch.bfloat16)
Perturb = Callable[[str, torch.Tensor], None]  # changes tensor `name`'s mean in place (differential privacy's noise)


class WeightedSum:
    """A streaming weighted sum: fold contributions as they arrive, read the average at the end.

    `wide`: float tensors accumulate in float64, so the average does not depend on the order of the
    folds; else in their own precision (half floats in float32), for models too large for that.
    """

    def __init__(self, wide: bool = True) -> None:
        self.wide = wide
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
        chunks = getattr(weights, "chunks", None)
        if callable(chunks):  # streamed from storage (apiary.streamed_weights): folded chunk by chunk
            self._fold_chunks(weights, chunks(), samples)
            return
        if self._sum and weights.keys() != self._sum.keys():
            raise InvalidContribution("contribution's tensor names differ from the accumulated ones")
        for added, (name, tensor) in enumerate(weights.items()):
            if not all_finite(tensor):
                self._refuse(name, added)
            acc = self._sum.get(name)
            if acc is None:
                self._sum[name] = self._start(name, tensor, samples)
            else:  # a narrower tensor is widened element by element, without a copy of it
                acc.add_(tensor, alpha=samples)
        self.total_samples += samples
        self.count += 1

    def _fold_chunks(self, weights: Mapping[str, torch.Tensor], chunks: Iterable[tuple[str, int, torch.Tensor]],
                     samples: int) -> None:
        """`fold` for weights that come as (name, element offset, flat values) chunks and declare their spec: each
        chunk is checked and added into its place (the same bits as whole tensors: the operations are elementwise);
        a refusal part way behaves as `fold`'s."""
        spec: WeightSpec = weights.declared_spec  # type: ignore[attr-defined]
        if self._sum and spec.keys() != self._sum.keys():
            raise InvalidContribution("contribution's tensor names differ from the accumulated ones")
        for added, (name, offset, values) in enumerate(chunks):
            if not all_finite(values):
                self._refuse(name, added)
            acc = self._sum.get(name)
            if acc is None:
                dtype = spec[name].dtype
                self._dtypes[name] = dtype
                acc = self._sum[name] = torch.empty(spec[name].shape, dtype=torch.float64 if self.wide
                                                    else step_dtype(dtype))
            region = acc.view(-1)[offset : offset + values.numel()]
            if self.count:
                region.add_(values, alpha=samples)
            else:  # the first contribution starts the sum, as `_start` does
                region.copy_(values).mul_(samples)
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
        # The first contribution starts the sum (no zeroed accumulator to read).
        self._dtypes[name] = tensor.dtype
        start = tensor.to(torch.float64 if self.wide else step_dtype(tensor.dtype))
        return torch.mul(tensor, samples) if start is tensor else start.mul_(samples)

    def _usable(self) -> None:
        if self.count < 0:
            raise ValueError("this average is finished: start a new sum")
        if self.spoiled:
            raise ValueError(f"this sum is spoiled: {self.spoiled}; rebuild it from the accepted contributions")

    def finish(self, cast: bool = True, perturb: Perturb | None = None) -> dict[str, torch.Tensor]:
        """The weighted average, computed in place in the accumulator (no second model in memory);
        the accumulator cannot be folded into afterwards.

        With `cast=False` each mean is in `step_dtype` of its tensor's dtype (`as_dtype` with `dtypes`
        casts it back later), for strategies that compute further on it; either way it is rounded from
        the accumulator once. `perturb` (differential privacy's noise) changes each float mean in place in
        the accumulator's precision (float64 while `wide`), before that rounding.
        """
        self._readable()
        out = {name: acc.div_(self.total_samples) for name, acc in self._sum.items()}
        if perturb is not None:
            for name, mean in out.items():
                if self._dtypes[name].is_floating_point:
                    perturb(name, mean)
        out = {name: as_dtype(mean, self._dtypes[name]) if cast else mean.to(step_dtype(self._dtypes[name]))
               for name, mean in out.items()}
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


def step_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision a mean of `dtype` tensors is computed further in: a float's own, float32 for half
    floats, float64 for integers and booleans."""
    if not dtype.is_floating_point:
        return torch.float64
    return torch.float32 if dtype in _HALF else dtype


def fits_wide(spec: WeightSpec) -> bool:
    """Whether a model of this spec is summed in float64: its float tensors' float64 accumulator takes at
    most WIDE_SUM_MAX_BYTES."""
    elements = sum(math.prod(t.shape) for t in spec.values() if t.dtype.is_floating_point)
    return elements * 8 <= WIDE_SUM_MAX_BYTES


def as_dtype(mean: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mean back in its tensor's dtype: floats cast, booleans by majority, integers rounded."""
    if dtype.is_floating_point:
        return mean.to(dtype)
    if dtype == torch.bool:
        return mean >= 0.5
    return torch.round(mean).to(dtype)
