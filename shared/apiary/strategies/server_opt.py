"""What the strategies with a server-side optimiser share (FedAvgM, FedAdam, FedYogi, FedAdagrad).

They fold contributions into FedAvg's streaming weighted sum, then move the round's global weights
towards that mean with an optimiser step whose state (momentum, moments) outlives the round. Memory:
the accumulator plus one tensor per state slot, whatever the number of workers; the step runs in
place in the accumulator, in its precision (float32 for half-float models), tensor by tensor.
Non-float tensors (counters) take FedAvg's mean: an optimiser step means nothing for them.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch
from pydantic import BaseModel

from apiary.strategies.fedavg import FedAvg
from apiary.strategies.weighted_sum import as_dtype

ROUNDS = "rounds"  # the state entry counting the optimiser steps taken (Flower's server_round - 1)


class ServerOptimizer(FedAvg):
    """FedAvg's mean, then a server optimiser step from the global weights; state in named slots."""

    aliases = ()  # FedAvg's "fedavg" names FedAvg only
    slots: ClassVar[tuple[str, ...]] = ()  # the per-tensor state this optimiser keeps, e.g. ("m_t", "v_t")

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        self.rounds = 0
        self._state: dict[str, dict[str, torch.Tensor]] = {slot: {} for slot in self.slots}

    def wants_global_weights(self) -> bool:
        """The step starts from the round's global weights."""
        return True

    def _aggregate(self, global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        if global_weights is None:
            raise ValueError(f"strategy {self.name!r} needs the round's global weights to take its step")
        dtypes = self._sum.dtypes
        means = self._sum.finish(cast=False, perturb=self.perturb)
        for name, mean in means.items():
            if mean.is_floating_point():
                current = global_weights[name].to(mean.dtype)
                means[name] = self._step(name, mean, current)
            means[name] = as_dtype(means[name], dtypes[name])
        self.rounds += 1
        return means

    @abstractmethod
    def _step(self, name: str, mean: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """Tensor `name`'s new value from the round's mean (free to overwrite) and its current value."""

    def _slot(self, slot: str, name: str, like: torch.Tensor) -> torch.Tensor:
        """Tensor `name`'s state in `slot`, zeros on the first step (Flower's `np.zeros_like`)."""
        tensor = self._state[slot].get(name)
        if tensor is None:
            tensor = self._state[slot][name] = torch.zeros_like(like)
        elif tensor.shape != like.shape or tensor.dtype != like.dtype:
            raise ValueError(f"strategy {self.name!r}: stored {slot} of {name!r} is {tensor.dtype} "
                             f"{tuple(tensor.shape)}, the round's tensor {like.dtype} {tuple(like.shape)}")
        return tensor

    def state(self) -> dict[str, torch.Tensor]:
        """The steps taken and each slot's tensors, as `<slot>.<tensor name>`."""
        out = {f"{slot}.{name}": tensor for slot, tensors in self._state.items() for name, tensor in tensors.items()}
        return {ROUNDS: torch.tensor(self.rounds, dtype=torch.int64), **out}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what `state` returned after an earlier round (an empty state is a first round)."""
        self.rounds = int(state[ROUNDS]) if ROUNDS in state else 0
        self._state = {slot: {} for slot in self.slots}
        for key, tensor in state.items():
            slot, _, name = key.partition(".")
            if key == ROUNDS:
                continue
            if slot not in self._state or not name:
                raise ValueError(f"strategy {self.name!r} keeps {', '.join(self.slots) or 'no slots'}, got {key!r}")
            self._state[slot][name] = tensor
