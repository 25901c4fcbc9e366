"""FedYogi (`fedyogi`): FedOpt with Yogi's additive second moment, as Flower 1.42's FedYogi."""

from __future__ import annotations

import torch

from apiary.strategies.base import register
from apiary.strategies.fedopt import FedOpt, fedopt_params


@register
class FedYogi(FedOpt):
    """`v_t = v_t - (1 - beta_2) * delta^2 * sign(v_t - delta^2)`: v_t moves by at most (1 - beta_2) delta^2."""

    name = "fedyogi"
    Params = fedopt_params("FedYogiParams", eta=1e-2, eta_l=0.0316, beta_1=0.9, beta_2=0.99, tau=1e-3)

    def _second_moment(self, v_t: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        squared = delta.square()
        direction = torch.sub(v_t, squared).sign_()
        return v_t.addcmul_(squared, direction, value=-(1.0 - self.beta_2))
