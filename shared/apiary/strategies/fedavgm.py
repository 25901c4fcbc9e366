"""FedAvgM (`fedavgm`): FedAvg with server momentum (Hsu et al., 2019), as Flower 1.42's FedAvgM.

The pseudo-gradient is `g = w - mean`; with momentum `v = server_momentum * v + g` (v = g on the
first step); the new weights are `w - server_learning_rate * v`. With the defaults (1.0, 0.0) this
is FedAvg, and Flower then takes no step: neither does this class (nor does it need the weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from pydantic import BaseModel, Field

from apiary.strategies.base import StrategyParams, register
from apiary.strategies.fedavg import FedAvg
from apiary.strategies.server_opt import ServerOptimizer


class FedAvgMParams(StrategyParams):
    """FedAvgM's parameters, with Flower's names and defaults."""

    server_learning_rate: float = Field(1.0, gt=0.0)
    server_momentum: float = Field(0.0, ge=0.0)


@register
class FedAvgM(ServerOptimizer):
    """FedAvg with server momentum; the momentum buffer is its server state."""

    name = "fedavgm"
    Params = FedAvgMParams
    slots = ("momentum",)

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        settings = cast(FedAvgMParams, self.params)
        self.lr, self.momentum = settings.server_learning_rate, settings.server_momentum
        # Flower's `server_opt`: whether a step is taken at all.
        self.steps = self.lr != 1.0 or self.momentum != 0.0

    def wants_global_weights(self) -> bool:
        """Only where a step is taken (or adapter tensors are merged into them)."""
        return self.steps or FedAvg.wants_global_weights(self)

    def _aggregate(self, global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        return super()._aggregate(global_weights) if self.steps else FedAvg._aggregate(self, global_weights)

    def _step(self, name: str, mean: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        gradient = mean.sub_(current).neg_()  # current - mean, exactly (negation is exact)
        if self.momentum > 0.0:
            if self.rounds:  # Flower: `server_round > 1`
                momentum = self._slot("momentum", name, gradient).mul_(self.momentum).add_(gradient)
            else:
                momentum = self._state["momentum"][name] = gradient.clone()
            return torch.sub(current, momentum, alpha=self.lr, out=gradient)
        return gradient.mul_(-self.lr).add_(current)
