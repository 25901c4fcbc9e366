"""FedMedian (`fedmedian`): each element's median across contributions (Yin et al., 2018), unweighted,
as Flower 1.42's `aggregate_median` (numpy's median: the mean of the two middle values for even K)."""

from __future__ import annotations

import torch

from apiary.strategies.base import register
from apiary.strategies.readback import ReadBack


@register
class FedMedian(ReadBack):
    """The coordinate-wise median: robust to fewer than half of the contributions being arbitrary."""

    name = "fedmedian"

    def _combine(self, block: torch.Tensor) -> torch.Tensor:
        return median(block)


def median(block: torch.Tensor) -> torch.Tensor:
    """numpy's median over the first dimension (torch.median takes the lower middle value instead)."""
    count = block.shape[0]
    ordered = block.sort(dim=0).values
    if count % 2:
        return ordered[count // 2]
    return ordered[count // 2 - 1].add(ordered[count // 2]).div_(2)
