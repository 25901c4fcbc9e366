"""SCAFFOLD (`scaffold`): stochastic controlled averaging (Karimireddy et al., ICML 2020), Algorithm 1.

Each worker trains from the global weights x with every gradient corrected to `g - c_i + c`
(apiary.sdk.Scaffold), where c_i, the shard's control variate, is its shard state (apiary.shard_state) and c, the
server's, is this strategy's server state, handed to every worker with the round. A worker uploads its weights y_i
and its shard's new state c_i⁺; the aggregator derives the control variate's change `Δc_i = c_i⁺ - c_i` from that
and the shard's previous state (`control_deltas`) and hands it in with the weights as `control_delta.<name>`
tensors. The server takes unweighted means over the round's |S| contributions, as the paper does:

    x <- x + eta_g * mean(y_i - x)        c <- c + |S| / N * mean(Δc_i)        (N: the shards a round trains)

Memory: two streaming sums (weights, control deltas) plus c, whatever the number of contributions; in float64
while the model fits WIDE_SUM_MAX_BYTES, so the result does not depend on the order of arrival.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, cast

import torch
from pydantic import BaseModel, Field

from apiary.shard_state import CONTROL_DELTA, SCAFFOLD_STATE
from apiary.strategies.base import Contribution, Strategy, StrategyParams, register
from apiary.strategies.validation import InvalidContribution, all_finite
from apiary.strategies.weighted_sum import WeightedSum, as_dtype, fits_wide, step_dtype
from apiary.weights import TensorSpec

CONTROL = "control."  # the server control variate's entries in the state: `control.<tensor name>`


class ScaffoldParams(StrategyParams):
    """SCAFFOLD's parameters: the server's step size and which control-variate update the workers make."""

    server_learning_rate: float = Field(1.0, gt=0.0, description="eta_g: the server's step towards the mean")
    control_variate_update: Literal["I", "II"] = Field(
        "II", description="the paper's option I (c_i = the local gradient at the global weights) or II "
        "(c_i - c + (x - y_i) / (K * eta_l), from the local steps)")


@register
class Scaffold(Strategy):
    """SCAFFOLD: FedAvg's unweighted mean with a server step, and a control variate that corrects client drift."""

    name = "scaffold"
    Params = ScaffoldParams
    shares_state = True

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        self.lr = cast(ScaffoldParams, self.params).server_learning_rate
        self.shards = 0  # N, set by `population`; 0: every contribution's shard is all there is
        self.control: dict[str, torch.Tensor] = {}
        self._sum = WeightedSum()
        self._delta = WeightedSum()
        self._delta_keys: frozenset[str] | None = None
        self._incoming: dict[str, torch.Tensor] = {}

    def population(self, shards: int) -> None:
        """N, the shards the job's rounds train: c moves by |S| / N of the mean control delta."""
        self.shards = shards

    def wants_global_weights(self) -> bool:
        """A server step other than 1 starts from the round's global weights (as adapter rounds merge into them)."""
        return self.lr != 1.0 or super().wants_global_weights()

    def _begin(self) -> None:
        wide = fits_wide(self.spec)
        self._sum, self._delta = WeightedSum(wide=wide), WeightedSum(wide=wide)
        self._delta_keys = None

    def accept(self, contribution: Contribution) -> None:
        """Split the control deltas from the weights, check them, then validate and fold both."""
        weights = {k: v for k, v in contribution.weights.items() if not k.startswith(CONTROL_DELTA)}
        delta = {k.removeprefix(CONTROL_DELTA): v for k, v in contribution.weights.items()
                 if k.startswith(CONTROL_DELTA)}
        self._check_delta(delta)
        self._incoming = delta
        try:
            super().accept(Contribution(weights, contribution.samples, contribution.metrics))
        finally:
            self._incoming = {}
        self._delta_keys = frozenset(delta)

    def _check_delta(self, delta: Mapping[str, torch.Tensor]) -> None:
        if self._delta_keys is not None and frozenset(delta) != self._delta_keys:
            raise InvalidContribution(f"control deltas name other tensors than the round's first contribution "
                                      f"({len(delta)} vs {len(self._delta_keys)})")
        for name in sorted(delta):
            want = self.spec.get(name)
            tensor = delta[name]
            if want is None or not want.dtype.is_floating_point:
                raise InvalidContribution(f"control delta {name!r} names no float tensor of the model")
            got = TensorSpec(tensor.dtype, tuple(tensor.shape))
            if got != want:
                raise InvalidContribution(f"control delta {name!r} is {got.describe()}, expected {want.describe()}")
            if not all_finite(tensor):
                raise InvalidContribution(f"control delta {name!r} has NaN or infinite values")

    def _fold(self, contribution: Contribution) -> None:
        # Unweighted, as Algorithm 1 averages; the deltas were checked in full, so only the weights can refuse.
        self._sum.fold(contribution.weights, 1)
        if self._incoming:
            self._delta.fold(self._incoming, 1)

    def _aggregate(self, global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        dtypes = self._sum.dtypes
        means = self._sum.finish(cast=False, perturb=self.perturb)
        if self.lr != 1.0:
            if global_weights is None:
                raise ValueError("SCAFFOLD with server_learning_rate != 1 needs the round's global weights")
            for name, mean in means.items():
                if mean.is_floating_point():
                    current = global_weights[name].to(mean.dtype)
                    means[name] = mean.sub_(current).mul_(self.lr).add_(current)
        self._update_control()
        return {name: as_dtype(mean, dtypes[name]) for name, mean in means.items()}

    def _update_control(self) -> None:
        """c <- c + |S| / N * mean(Δc_i), in the accumulator's precision, rounded once to c's dtype."""
        count = self._delta.count
        if count <= 0:
            return
        dtypes = self._delta.dtypes
        scale = count / max(self.shards, count)
        for name, mean in self._delta.finish(cast=False).items():
            old = self.control.get(name)
            step = mean.to(torch.float64 if self._delta.wide else step_dtype(dtypes[name])).mul_(scale)
            new = step if old is None else step.add_(old.to(step.dtype))
            self.control[name] = new.to(dtypes[name])

    @property
    def spoiled(self) -> str | None:
        """Why the running sums can no longer be used, if a refused contribution was partly added."""
        return self._sum.spoiled or self._delta.spoiled

    def state(self) -> dict[str, torch.Tensor]:
        """The server control variate c, as `control.<tensor name>` (absent names are zero)."""
        return {f"{CONTROL}{name}": tensor for name, tensor in self.control.items()}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore c from `state` (empty: a first round, c = 0)."""
        control = {}
        for key, tensor in state.items():
            if not key.startswith(CONTROL):
                raise ValueError(f"strategy {self.name!r} keeps only control.<name> entries, got {key!r}")
            control[key.removeprefix(CONTROL)] = tensor
        self.control = control


def control_deltas(new: Mapping[str, torch.Tensor], previous: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A contribution's control-variate change `Δc_i = c_i⁺ - c_i` as `control_delta.<name>` tensors, from its
    shard's new state and the state it trained from (c_i zero where that has none, as the worker took it)."""
    deltas = {}
    for key, new_c in new.items():
        if not key.startswith(SCAFFOLD_STATE):
            continue
        old = previous.get(key)
        usable = old is not None and old.shape == new_c.shape and old.dtype == new_c.dtype
        deltas[CONTROL_DELTA + key.removeprefix(SCAFFOLD_STATE)] = new_c - old if old is not None and usable \
            else new_c.clone()
    return deltas


def control_of(server_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The server control variate c from the server state a round hands its workers."""
    return {k.removeprefix(CONTROL): v for k, v in server_state.items() if k.startswith(CONTROL)}

