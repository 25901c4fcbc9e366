"""What the order-statistic strategies share (FedMedian, FedTrimmedAvg, Krum, MultiKrum).

They cannot fold: each needs every contribution's value of an element at once. So they keep nothing
while contributions arrive (the aggregator stores them anyway) and read them back at the close, one
tensor at a time and that tensor in column chunks of `CHUNK` elements: peak extra memory is about
K x one chunk (3-4 copies while sorting) plus the new model, whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from apiary.strategies.base import Contribution, StoredContributions, Strategy
from apiary.strategies.validation import InvalidContribution, all_finite
from apiary.strategies.weighted_sum import as_dtype

CHUNK = 1 << 20  # elements per column chunk: 4 MiB a contribution for float32


class ReadBack(Strategy):
    """A strategy that reads the round's contributions back at the close instead of folding them."""

    streaming = False

    def _begin(self) -> None:
        """Nothing to reset: the strategy keeps nothing but what the base counts."""

    def _fold(self, contribution: Contribution) -> None:
        # Only the values are checked here; the contribution itself is read back from storage.
        for name, tensor in contribution.weights.items():
            if not all_finite(tensor):
                raise InvalidContribution(f"tensor {name!r} has NaN or infinite values")

    def _aggregate(self, global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"strategy {self.name!r} reads its contributions back: finish needs `stored`")

    def _read_back(
        self, stored: StoredContributions, global_weights: Mapping[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """Each tensor of the round combined across contributions by `_combine`, chunk by chunk."""
        return {name: by_columns(stored.tensor(name), self._combine) for name in self.round_names(stored)}

    def _combine(self, block: torch.Tensor) -> torch.Tensor:
        """One value per column of `block` (K contributions x C elements)."""
        raise NotImplementedError(f"strategy {self.name!r} combines its contributions in _read_back")

    def round_names(self, stored: StoredContributions) -> list[str]:
        """The round's tensor names in the model's order, once `stored` is checked against the round."""
        if self._keys is None:
            raise ValueError("no contribution was accepted: nothing to aggregate")
        if len(stored.samples) != len(self._metrics):
            raise ValueError(f"{len(stored.samples)} stored contributions for {len(self._metrics)} accepted ones")
        return [name for name in self.spec if name in self._keys]


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision order statistics are computed in: floats as they are (half floats in float32),
    integers and booleans in float64 (as numpy's median of integers)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype if dtype.is_floating_point else torch.float64


def column_blocks(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[slice, torch.Tensor]]:
    """The same elements of every tensor side by side: (where, K x C block), `CHUNK` columns at a time."""
    flat = [tensor.reshape(-1) for tensor in tensors]
    work = working_dtype(tensors[0].dtype)
    for start in range(0, flat[0].numel(), CHUNK):
        where = slice(start, start + CHUNK)
        yield where, torch.stack([f[where] for f in flat]).to(work)


def by_columns(tensors: Sequence[torch.Tensor], combine: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`combine` applied to every column of the stacked tensors, in the tensors' shape and dtype."""
    first = tensors[0]
    out = torch.empty(first.numel(), dtype=working_dtype(first.dtype))
    for where, block in column_blocks(tensors):
        out[where] = combine(block)
    return as_dtype(out.view(first.shape), first.dtype)
