"""FedAdam (`fedadam`): FedOpt with Adam's second moment and bias-corrected rate, as Flower 1.42's."""

from __future__ import annotations

import math

import torch

from apiary.strategies.base import register
from apiary.strategies.fedopt import FedOpt, fedopt_params


@register
class FedAdam(FedOpt):
    """`v_t = beta_2 * v_t + (1 - beta_2) * delta^2`; the rate is corrected for the moments' zero start."""

    name = "fedadam"
    Params = fedopt_params("FedAdamParams", eta=1e-1, eta_l=1e-1, beta_1=0.9, beta_2=0.99, tau=1e-9)

    def _second_moment(self, v_t: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return v_t.mul_(self.beta_2).addcmul_(delta, delta, value=1.0 - self.beta_2)

    def _rate(self) -> float:
        # Flower's eta_norm, with its exponent `server_round + 1` (server_round counts from 1).
        exponent = self.rounds + 2.0
        return float(self.eta * math.sqrt(1 - self.beta_2**exponent) / (1 - self.beta_1**exponent))
