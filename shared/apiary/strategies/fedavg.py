"""FedAvg (`federated_averaging`, alias `fedavg`): the new global weights are the sample-weighted mean
of the round's contributions, `w = sum(n_i * w_i) / sum(n_i)`, folded as they arrive."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from pydantic import BaseModel

from apiary.strategies.base import Contribution, Strategy, register
from apiary.strategies.weighted_sum import WeightedSum, fits_wide


@register
class FedAvg(Strategy):
    """Federated averaging (McMahan et al., 2017); keeps no server state between rounds."""

    name = "federated_averaging"
    aliases: ClassVar[tuple[str, ...]] = ("fedavg",)  # its subclasses name themselves only
    perturbs_mean = True

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        self._sum = WeightedSum()

    def _begin(self) -> None:
        # In float64 (the same bits whichever worker reports first) while that fits WIDE_SUM_MAX_BYTES.
        self._sum = WeightedSum(wide=fits_wide(self.spec))

    def _fold(self, contribution: Contribution) -> None:
        self._sum.fold(contribution.weights, contribution.samples)

    def _aggregate(self, global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        # In place in the accumulator: no second model in memory.
        return self._sum.finish(perturb=self.perturb)

    @property
    def spoiled(self) -> str | None:
        """Why the running sum can no longer be used, if a refused contribution was partly added."""
        return self._sum.spoiled
