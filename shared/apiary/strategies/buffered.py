"""Buffered asynchronous aggregation (FedBuff, Nguyen et al., AISTATS 2022) over the strategy seam.

A worker trains from global version `v_start` and returns its weights `w`; by the time they arrive the
newest version is `x` (the buffer's start), `s` versions later (its staleness). Its delta is
`d = w - x_start`. FedBuff folds `K` deltas into `D = sum(n_i * g(s_i) * d_i) / sum(n_i)` (samples
times a staleness weight `g`, normalised by the samples alone, so a stale update counts for less) and
steps `x <- x + lr * D` (with momentum `m <- beta * m + D`, `x <- x + lr * m`, as FLSim's
FedAvgWithLRHybridAggregator over a server SGD optimiser).

It is the strategies' own fold in disguise: each update is *rebased* onto the buffer's start,
`u_i = x + g(s_i) * d_i`, and handed with its samples to the inner strategy; the inner FedAvg mean is
then exactly `x + D`. FedAvgM's step on that mean is FedBuff's server step (its pseudo-gradient is
`-D`), and FedAdam / FedYogi / FedAdagrad take their optimiser step on the same pseudo-gradient
(FedBuff's server optimisers). Memory: the inner accumulator, the buffer's start and one update with
its start version, whatever K. Non-float tensors (counters) are folded as returned.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from apiary.jobspec_async import FEDAVG_NAMES, AsyncConfig
from apiary.strategies.base import Contribution, RoundResult, Strategy, create
from apiary.strategies.format import UpdateFormat
from apiary.strategies.validation import InvalidContribution, validate
from apiary.weights import WeightSpec

FEDBUFF_STEP = "fedavgm"  # FedAvg with a server learning rate and momentum: FedBuff's server step


def staleness_weight(settings: AsyncConfig, staleness: int) -> float:
    """g(s): how much an update `staleness` versions old counts (FLSim's constant, polynomial and hinge
    staleness weights)."""
    if staleness < 0:
        raise ValueError(f"staleness must not be negative, got {staleness}")
    if settings.staleness_weight == "constant":
        return 1.0
    if settings.staleness_weight == "polynomial":
        return float((1.0 + staleness) ** -settings.staleness_exponent)
    if staleness <= settings.hinge_b:
        return 1.0
    return 1.0 / (settings.hinge_a * (staleness - settings.hinge_b) + 1.0)


def inner_strategy(name: str, params: Mapping[str, object], settings: AsyncConfig) -> Strategy:
    """The strategy that takes the buffer's server step: FedAvg becomes FedAvgM with FedBuff's server
    learning rate and momentum; the FedOpt family keeps its own parameters."""
    if name in FEDAVG_NAMES:
        return create(FEDBUFF_STEP, {"server_learning_rate": settings.server_learning_rate,
                                     "server_momentum": settings.server_momentum})
    return create(name, params)


def rebased(update: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor],
            current: Mapping[str, torch.Tensor], weight: float) -> dict[str, torch.Tensor]:
    """`current + weight * (update - start)` tensor by tensor, in float32 or wider, in each tensor's dtype;
    non-float tensors as the update has them."""
    out = {}
    for name, tensor in update.items():
        if not tensor.is_floating_point():
            out[name] = tensor
            continue
        wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        delta = tensor.to(wide) - start[name].to(wide)
        out[name] = torch.add(current[name].to(wide), delta, alpha=weight).to(tensor.dtype)
    return out


class Buffer:
    """One version's buffer: updates folded as they arrive, the server step at `finish`."""

    def __init__(self, inner: Strategy, settings: AsyncConfig) -> None:
        self.inner, self.settings = inner, settings
        self.count = 0
        self._current: Mapping[str, torch.Tensor] = {}

    def begin(self, spec: WeightSpec, update_format: UpdateFormat, current: Mapping[str, torch.Tensor]) -> None:
        """Start the buffer from the newest version's weights `current` (spec `spec`)."""
        self._current, self.count = current, 0
        self.inner.begin(spec, update_format, current if self.inner.needs_start_weights() else None)

    def accept(self, contribution: Contribution, start: Mapping[str, torch.Tensor], staleness: int) -> float:
        """Fold one update trained from `start`, `staleness` versions old; its staleness weight. Raises
        InvalidContribution (why) for one that must not enter, before anything is folded."""
        validate(self.inner.spec, contribution.weights, contribution.samples,
                 partial=self.inner.format is UpdateFormat.ADAPTER)
        missing = [n for n in contribution.weights if n not in start or n not in self._current]
        if missing:
            raise InvalidContribution(f"tensor {missing[0]!r} is not in the version it was trained from")
        weight = staleness_weight(self.settings, staleness)
        update = rebased(contribution.weights, start, self._current, weight)
        self.inner.accept(Contribution(update, contribution.samples, contribution.metrics))
        self.count += 1
        return weight

    def finish(self) -> RoundResult:
        """The new version: the inner strategy's result over the rebased updates, from the buffer's start."""
        return self.inner.finish(dict(self._current))

    @property
    def spoiled(self) -> str | None:
        """Why the running sum can no longer be used (see Strategy.spoiled)."""
        return self.inner.spoiled

    def state(self) -> dict[str, torch.Tensor]:
        """The server optimiser's state (momentum, moments), stored with each version."""
        return self.inner.state()

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore the state the previous version left."""
        self.inner.load_state(state)
