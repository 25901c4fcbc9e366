"""FedTrimmedAvg (`fedtrimmedavg`): each element's mean once the `beta` fraction of lowest and of highest
values is cut (Yin et al., 2018), unweighted, as Flower 1.42's `aggregate_trimmed_avg`."""

from __future__ import annotations

from typing import cast

import torch
from pydantic import BaseModel, Field

from apiary.strategies.base import StrategyParams, register
from apiary.strategies.readback import ReadBack


class FedTrimmedAvgParams(StrategyParams):
    """FedTrimmedAvg's parameter, with Flower's name, default and range."""

    beta: float = Field(0.2, ge=0.0, lt=0.5, description="fraction cut at each end")


@register
class FedTrimmedAvg(ReadBack):
    """The coordinate-wise trimmed mean; cuts `int(beta * K)` values at each end.

    A beta below 0.5 keeps at least one value of any K, so every job fits: the range of `beta` is
    what refuses a beta that would trim every contribution.
    """

    name = "fedtrimmedavg"
    Params = FedTrimmedAvgParams

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        self.beta = cast(FedTrimmedAvgParams, self.params).beta

    def _combine(self, block: torch.Tensor) -> torch.Tensor:
        count = block.shape[0]
        cut = int(self.beta * count)  # Flower's (and scipy's) lowercut
        return block.sort(dim=0).values[cut:count - cut].mean(dim=0)
