"""FedOpt (Reddi et al., 2021), as Flower 1.42's FedOpt: the base of FedAdam, FedYogi and FedAdagrad.

Each round: `delta = mean - w`, `m_t = beta_1 * m_t + (1 - beta_1) * delta`, `v_t` by the subclass's
rule, `w = w + rate * m_t / (sqrt(v_t) + tau)`; `m_t` and `v_t` start as zeros on the first step
(Flower's `np.zeros_like`) and are the server state. `eta_l` is the workers' learning rate: Flower
validates and keeps it for the clients and its server step never reads it; so here.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from pydantic import BaseModel, Field, create_model

from apiary.strategies.base import StrategyParams
from apiary.strategies.server_opt import ServerOptimizer

FIELDS: dict[str, tuple[dict[str, Any], str]] = {  # name: (constraints, description)
    "eta": ({"gt": 0.0}, "server learning rate"),
    "eta_l": ({"gt": 0.0}, "workers' learning rate (not used by the server step)"),
    "beta_1": ({"ge": 0.0, "lt": 1.0}, "first moment decay"),
    "beta_2": ({"ge": 0.0, "lt": 1.0}, "second moment decay"),
    "tau": ({"gt": 0.0}, "adaptivity: keeps the step finite where v_t is 0"),
}


def fedopt_params(name: str, **defaults: float) -> Any:
    """The parameter model of one FedOpt strategy: the fields Flower's class takes, with its defaults."""
    fields: dict[str, Any] = {
        field: (float, Field(default, description=FIELDS[field][1], **FIELDS[field][0]))
        for field, default in defaults.items()
    }
    doc = f"{name.removesuffix('Params')}'s parameters, with Flower's names and defaults."
    return create_model(name, __base__=StrategyParams, __doc__=doc, **fields)


class FedOpt(ServerOptimizer):
    """A server optimiser with first and second moments; subclasses say how `v_t` moves."""

    slots = ("m_t", "v_t")

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        values = self.params.model_dump()
        self.eta, self.eta_l, self.tau = values["eta"], values["eta_l"], values["tau"]
        # FedAdagrad takes no decays: Flower's FedAdagrad passes 0.0 for both.
        self.beta_1, self.beta_2 = values.get("beta_1", 0.0), values.get("beta_2", 0.0)

    def _step(self, name: str, mean: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        delta = mean.sub_(current)
        m_t = self._slot("m_t", name, delta).mul_(self.beta_1).add_(delta, alpha=1.0 - self.beta_1)
        v_t = self._second_moment(self._slot("v_t", name, delta), delta)
        denominator = v_t.sqrt().add_(self.tau)
        # delta is not needed any more: the new weights take its memory.
        return torch.addcdiv(current, m_t, denominator, value=self._rate(), out=delta)

    def _rate(self) -> float:
        """The step's learning rate this round."""
        return float(self.eta)

    @abstractmethod
    def _second_moment(self, v_t: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Update `v_t` in place from this round's `delta` and return it."""
