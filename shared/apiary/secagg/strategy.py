"""Secure aggregation at the strategy seam: a round's contributions are masked vectors, checked by the round's
`Collector` and summed in the ring here; at the finish the collector unmasks the sum and the mean update becomes
the wrapped strategy's one contribution (apiary.secagg.aggregate). Pure: the aggregator relays the protocol's
stages and hands the collector in. The sum is this strategy's, like any round's running state: a round
recovered from its stored contributions sums them again, exactly those its rows accept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from apiary.secagg.aggregate import contribution_of_mean
from apiary.secagg.messages import node
from apiary.secagg.protocol import Collector, SecAggError, add_masked
from apiary.secagg.updates import MASKED, from_wire
from apiary.strategies.base import Contribution, RoundResult, StoredContributions, Strategy, Wrapping, weighted_metrics
from apiary.strategies.clipping import clip_for_upload
from apiary.strategies.format import UpdateFormat
from apiary.strategies.private import DifferentiallyPrivate
from apiary.strategies.validation import InvalidContribution
from apiary.weights import WeightSpec

# Round metrics: how many masked contributions the sum holds, and the most the mean update may be off per value.
CONTRIBUTORS, ERROR_BOUND = "secagg_contributors", "secagg_error_bound"


class MaskedSum(Wrapping):
    """Fold masked vectors into the round's collector; finish by unmasking and letting `inner` aggregate."""

    def __init__(self, inner: Strategy, collector: Collector | None, missing: str = "") -> None:
        super().__init__(inner)
        self.collector, self._missing = collector, missing
        self._global: Mapping[str, torch.Tensor] = {}
        self.total: np.ndarray | None = None  # the masked vectors' sum in the ring
        self.contributed: set[int] = set()  # whose vectors it holds (node ids)

    def begin(self, spec: WeightSpec, update_format: UpdateFormat,
              global_weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Start the round from `global_weights` (required)."""
        if global_weights is None:
            raise ValueError("secure aggregation needs the round's global weights to apply the mean update")
        if update_format is not UpdateFormat.FULL:
            raise ValueError("secure aggregation takes full-weight updates, not adapter-only ones")
        super().begin(spec, update_format)
        self._global = global_weights
        if self.collector is not None:
            self.collector.length = sum(math.prod(t.shape) for t in spec.values())
        self.inner.begin(spec, update_format, global_weights if self.inner.needs_start_weights() else None)

    def _begin(self) -> None:
        return None

    def accept(self, contribution: Contribution) -> None:
        """Fold a masked vector (its shard's) into the ring sum; InvalidContribution if it is not one."""
        if self.collector is None:  # the round cannot be unmasked: it fails at the finish, this is kept as is
            self.total_samples += contribution.samples
            return
        if contribution.shard is None:
            raise InvalidContribution("a masked contribution must name its shard")
        if set(contribution.weights) != {MASKED}:
            raise InvalidContribution(f"a masked contribution holds one tensor {MASKED!r}, got "
                                      f"{sorted(contribution.weights)[:3]}")
        if contribution.samples <= 0:
            raise InvalidContribution(f"sample count must be positive, got {contribution.samples}")
        n = node(contribution.shard)
        try:
            vector = from_wire(contribution.weights[MASKED].numpy())
            self.collector.check_masked(n, vector)
        except ValueError as e:
            raise InvalidContribution(str(e)) from None
        if n in self.contributed:  # in the sum already (it is summed once)
            return
        self.total = add_masked(self.total, vector, self.collector.params.modulus_range)
        self.contributed.add(n)
        self._metrics.append((contribution.samples, contribution.metrics))
        self.total_samples += contribution.samples

    def _fold(self, contribution: Contribution) -> None:  # accept() folds into the collector
        raise NotImplementedError

    def _aggregate(self, global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def wants_global_weights(self) -> bool:
        """Held since `begin`."""
        return False

    def finish(self, global_weights: Mapping[str, torch.Tensor] | None = None,
               stored: StoredContributions | None = None) -> RoundResult:
        """Unmask the sum (SecAggError, a ValueError, if too few shares were revealed) and let the wrapped strategy
        make the round of the mean."""
        if self.collector is None:
            raise SecAggError(self._missing or "no key agreement is held for this round")
        mean, total, contributors = self.collector.finish(self.total, self.contributed)
        one = contribution_of_mean(mean, self._global, total, weighted_metrics(self._metrics))
        if not isinstance(self.inner, DifferentiallyPrivate):
            self.inner.accept(one)
        elif self.inner.settings.noise_on == "worker":
            # The mean carries the workers' noise (clipping it back would scale the noise down with it); the wrapper
            # reports the std it leaves on the mean from the contributors' sample counts.
            self.inner.accept(one, squared_samples=sum(samples ** 2 for samples, _ in self._metrics))
        else:
            # The mean of updates clipped to C is within C; quantisation may move it a hair over, which the
            # privacy wrapper (clip_on worker) would refuse: clipped back, within the bound it verifies.
            weights, _ = clip_for_upload(one.weights, self._global, self.inner.clipping_norm)
            self.inner.accept(Contribution(weights, one.samples, one.metrics))
        result = self.inner.finish(self._global if self.inner.wants_global_weights() else None)
        metrics = {**result.metrics, CONTRIBUTORS: float(contributors),
                   ERROR_BOUND: self.collector.params.error_bound(contributors, total)}
        return RoundResult(result.weights, total, metrics)

    @property
    def spoiled(self) -> str | None:
        """A collector refuses a bad vector before adding any of it: never spoiled."""
        return None

    def state(self) -> dict[str, torch.Tensor]:
        """The wrapped strategy's."""
        return self.inner.state()

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """The wrapped strategy's."""
        self.inner.load_state(state)
