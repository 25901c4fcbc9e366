"""FedProx (`fedprox`): FedAvg's aggregation; the proximal term `mu/2 * ||w - w_global||^2` is added
to each worker's loss during training, where `proximal_mu` is handed to the trainer."""

from __future__ import annotations

from pydantic import Field

from apiary.strategies.base import StrategyParams, register
from apiary.strategies.fedavg import FedAvg


class FedProxParams(StrategyParams):
    """FedProx's parameter, as Flower names it (required, as in Flower)."""

    proximal_mu: float = Field(ge=0.0, description="weight of the proximal term in the training loss")


@register
class FedProx(FedAvg):
    """FedProx (Li et al., 2020): the server averages exactly as FedAvg (Flower's FedProx does too)."""

    name = "fedprox"
    aliases = ()  # FedAvg's "fedavg" names FedAvg only
    Params = FedProxParams
