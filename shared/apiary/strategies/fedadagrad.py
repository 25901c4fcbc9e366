"""FedAdagrad (`fedadagrad`): FedOpt with Adagrad's summed second moment, as Flower 1.42's FedAdagrad."""

from __future__ import annotations

import torch

from apiary.strategies.base import register
from apiary.strategies.fedopt import FedOpt, fedopt_params


@register
class FedAdagrad(FedOpt):
    """`v_t = v_t + delta^2`, no first-moment decay: Flower's FedAdagrad takes no beta_1 or beta_2."""

    name = "fedadagrad"
    Params = fedopt_params("FedAdagradParams", eta=1e-1, eta_l=1e-1, tau=1e-9)

    def _second_moment(self, v_t: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return v_t.addcmul_(delta, delta)
