"""Central differential privacy as a wrapper around any strategy (`distributed.differential_privacy`).

Each round: every update (contribution - the round's global weights) is clipped to the clipping norm C by one
L2 norm over its tensors (apiary.strategies.clipping); the wrapped strategy aggregates the clipped
contributions; Gaussian noise of std `z * C / m` (m: num_sampled_clients) is added to the aggregate, drawn in
float64 and rounded once to the model's dtype. For the FedAvg family the noise goes on the weighted mean of the
clipped contributions, before a server optimiser steps from it (FedAvgM, FedAdam, ...): the step is then
post-processing of a private release. Any other strategy gets it on its result, as Flower 1.42's wrapper does.

`clip_on: worker`: workers clip before upload, so the aggregator never holds an unclipped update; it measures each
update and refuses one over the norm as invalid. `noise_on: worker` (with clip_on worker, for the strategies that
average): each worker adds Gaussian noise of std `z * C / sqrt(m)` to its clipped update, so that the mean of m
updates carries the central std `z * C / m` and no noise is added here; the aggregator then refuses an update
over what a clipped one with that noise measures (apiary.strategies.clipping.noised_bound).

Adaptive clipping follows Andrew et al. 2021 ("Differentially private learning with adaptive clipping"): with
b_i = 1 when update i is NOT clipped (its norm <= C_t), the server releases
`b = (sum b_i + N(0, sigma_b^2)) / m` and sets `C_{t+1} = C_t * exp(-clip_norm_lr * (b - target_clipped_quantile))`;
the update's noise multiplier is `(z^-2 - (2 sigma_b)^-2)^-1/2` so that both releases together spend z. Flower
1.42 counts the *clipped* updates in b with the same sign, which moves the norm away from the target (see
docs/privacy.md); it also noises the update with the norm after its update, where the paper (and this) uses C_t.

Server state (with the wrapped strategy's own, under `strategy.`): the clipping norm the next round uses and the
releases made so far, from which ε follows (apiary.privacy.epsilon). Noise comes from a generator seeded from the
operating system's entropy at each release, or from (seed, release, tensor name) with the test-only `seed` setting.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from apiary.privacy import DifferentialPrivacy, spent
from apiary.strategies.base import Contribution, RoundResult, StoredContributions, Strategy, Wrapping
from apiary.strategies.clipping import clipped, float_size, noised_bound, over_bound, update_norm
from apiary.strategies.format import UpdateFormat
from apiary.strategies.validation import InvalidContribution, validate
from apiary.weights import WeightSpec

CLIPPING_NORM, RELEASES = "dp.clipping_norm", "dp.releases"  # this wrapper's state entries
INNER = "strategy."  # the prefix of the wrapped strategy's state entries
# Round metrics: ε spent so far at δ (target_delta; ε absent without noise), the norm this round clipped to, the
# noise's std on the aggregate, and (adaptive) the noised fraction of unclipped updates.
EPSILON, DELTA, NORM, NOISE_STD = "dp_epsilon", "dp_delta", "dp_clipping_norm", "dp_noise_std"
UNCLIPPED = "dp_unclipped_fraction"


class DifferentiallyPrivate(Wrapping):
    """Clip each update, let the wrapped strategy aggregate, add Gaussian noise; adapt the norm if asked."""

    def __init__(self, inner: Strategy, settings: DifferentialPrivacy) -> None:
        super().__init__(inner)
        self.settings = settings
        self.streaming = inner.streaming  # type: ignore[misc]
        self.clipping_norm = settings.clipping_start
        self.releases = 0
        self._global: Mapping[str, torch.Tensor] = {}
        self._unclipped = 0  # accepted updates within the norm this round (adaptive clipping's count)
        self._squared_samples = 0  # the sum of the accepted updates' squared sample counts (noise_on worker)

    def begin(self, spec: WeightSpec, update_format: UpdateFormat,
              global_weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Start the round from `global_weights` (required: updates are measured against them)."""
        if global_weights is None:
            raise ValueError("differential privacy needs the round's global weights to clip updates")
        super().begin(spec, update_format)
        self._global = global_weights
        self.inner.begin(spec, update_format)

    def _begin(self) -> None:
        self._unclipped = 0
        self._squared_samples = 0

    def accept(self, contribution: Contribution, squared_samples: int | None = None) -> None:
        """Validate, measure and clip the update (or, clipped on the worker, refuse it over the norm), then let
        the wrapped strategy take the clipped contribution. `squared_samples`: where the contribution is a mean of
        several (secure aggregation's), the sum of their squared sample counts (noise_on worker reports from it)."""
        weights = contribution.weights
        validate(self.spec, weights, contribution.samples, partial=self.format is UpdateFormat.ADAPTER,
                 expected_keys=self._keys)
        norm = update_norm(weights, self._global)
        noise_std = self.settings.worker_noise_std
        if noise_std > 0:  # noise_on worker: the update is clipped, then noised
            bound = noised_bound(self.clipping_norm, noise_std, float_size(weights))
            if norm > bound:
                raise InvalidContribution(f"update norm {norm:.6g} is over {bound:.6g}, the most a clipped update "
                                          f"(norm {self.clipping_norm:.6g}) with the workers' noise (std "
                                          f"{noise_std:.6g}) measures: the worker did not clip it")
        elif self.settings.clip_on == "worker" and over_bound(norm, self.clipping_norm):
            raise InvalidContribution(f"update norm {norm:.6g} is over the clipping norm {self.clipping_norm:.6g} "
                                      "(clip_on: worker): the worker did not clip it")
        # A strategy that reads contributions back gets them clipped then (ClippedContributions). Noised on the
        # worker, an update is over the norm by its noise, which clipping here would scale down with it.
        if self.streaming and self.settings.noise_on != "worker":
            weights = clipped(weights, self._global, self.clipping_norm, norm)
        self.inner.accept(Contribution(weights, contribution.samples, contribution.metrics))
        self._keys = frozenset(weights)
        self.total_samples += contribution.samples
        self._squared_samples += contribution.samples ** 2 if squared_samples is None else squared_samples
        self._unclipped += norm <= self.clipping_norm

    def _fold(self, contribution: Contribution) -> None:  # accept() hands contributions to the wrapped strategy
        raise NotImplementedError

    def _aggregate(self, global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def wants_global_weights(self) -> bool:
        """The wrapper holds them since `begin`."""
        return False

    def finish(self, global_weights: Mapping[str, torch.Tensor] | None = None,
               stored: StoredContributions | None = None) -> RoundResult:
        """The wrapped strategy's result on the clipped contributions, with noise; the clipping norm adapts."""
        settings, norm = self.settings, self.clipping_norm
        count_std, z_update = settings.adaptive_noise() if settings.clipping == "adaptive" else (0.0, 0.0)
        if settings.clipping == "fixed":
            z_update = settings.noise_multiplier
        std = z_update * norm / settings.sampled
        if settings.noise_on == "worker":
            # The workers added it: their noise's std on the sample-weighted mean is reported, none is added here.
            std = _mean_std(settings.worker_noise_std, self.total_samples, self._squared_samples)
            noise = _Noise(settings.seed, self.releases, 0.0)
        else:
            noise = _Noise(settings.seed, self.releases, std)
        inner = self.inner
        if inner.perturbs_mean:
            inner.perturb = noise
        if stored is not None and not inner.streaming and settings.noise_on != "worker":
            stored = ClippedContributions(stored, self._global, norm, sorted(self._keys or ()))
        given = self._global if inner.wants_global_weights() else None
        result = inner.finish(given, stored=stored)
        weights = result.weights
        if not inner.perturbs_mean:
            for name in self._keys or ():
                if weights[name].is_floating_point():
                    weights[name] = noise.added(name, weights[name])
        metrics = dict(result.metrics)
        if settings.clipping == "adaptive":
            count_noise = seeded(settings.seed, self.releases).normal(0.0, count_std) if count_std > 0 else 0.0
            noised = self._unclipped + count_noise
            fraction = float(noised) / settings.sampled
            self.clipping_norm = adapted_norm(norm, fraction, settings.target_clipped_quantile, settings.clip_norm_lr)
            metrics[UNCLIPPED] = fraction
        self.releases += 1
        epsilon = spent(settings, self.releases)["epsilon"]
        if epsilon is not None:
            metrics[EPSILON], metrics[DELTA] = epsilon, settings.target_delta
        metrics[NORM], metrics[NOISE_STD] = norm, std
        return RoundResult(weights, result.total_samples, metrics)

    @property
    def spoiled(self) -> str | None:
        """The wrapped strategy's."""
        return self.inner.spoiled

    def state(self) -> dict[str, torch.Tensor]:
        """The next round's clipping norm, the releases so far, and the wrapped strategy's state."""
        own = {CLIPPING_NORM: torch.tensor(self.clipping_norm, dtype=torch.float64),
               RELEASES: torch.tensor(self.releases, dtype=torch.int64)}
        return {**own, **{INNER + key: tensor for key, tensor in self.inner.state().items()}}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what `state` returned after an earlier round (an empty state is a first round)."""
        self.clipping_norm = float(state[CLIPPING_NORM]) if CLIPPING_NORM in state else self.settings.clipping_start
        self.releases = int(state[RELEASES]) if RELEASES in state else 0
        unknown = [key for key in state if key not in (CLIPPING_NORM, RELEASES) and not key.startswith(INNER)]
        if unknown:
            raise ValueError(f"differential privacy keeps {CLIPPING_NORM}, {RELEASES} and {INNER}*, got {unknown[0]!r}")
        self.inner.load_state({key.removeprefix(INNER): t for key, t in state.items() if key.startswith(INNER)})


def _mean_std(std: float, total: int, squared: int) -> float:
    """The std that independent noises of `std` on each update leave on their sample-weighted mean."""
    return std * math.sqrt(squared) / total if total > 0 else 0.0


def adapted_norm(norm: float, unclipped_fraction: float, target_quantile: float, lr: float) -> float:
    """Andrew et al. 2021's geometric update: the norm grows while fewer than the target quantile of updates
    fit within it, and shrinks while more do."""
    return norm * math.exp(-lr * (unclipped_fraction - target_quantile))


class _Noise:
    """Gaussian noise of one std for a round's tensors, drawn in float64 and added before rounding."""

    def __init__(self, seed: int | None, release: int, std: float) -> None:
        self._seed, self._release, self.std = seed, release, std
        self._rng = np.random.default_rng() if seed is None else None  # 128 bits of the OS's entropy

    def __call__(self, name: str, mean: torch.Tensor) -> None:
        """Add noise to a mean in place (float64 where the sum is wide: rounded to the dtype afterwards)."""
        if self.std > 0:
            mean.add_(self._draw(name, mean))

    def added(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` with noise added in float64, rounded once to its dtype."""
        if self.std <= 0:
            return tensor
        return tensor.double().add_(self._draw(name, tensor)).to(tensor.dtype)

    def _draw(self, name: str, like: torch.Tensor) -> torch.Tensor:
        # Seeded, each tensor's noise has a generator of its own: the same whatever order the tensors come in.
        rng = self._rng if self._rng is not None else seeded(self._seed, self._release, name)
        return torch.from_numpy(rng.normal(0.0, self.std, tuple(like.shape)))


def seeded(seed: int | None, release: int, name: str | None = None) -> np.random.Generator:
    """The test-only generator of a release's noise: for tensor `name`, or (None) for the count; OS entropy
    where `seed` is None."""
    if seed is None:
        return np.random.default_rng()
    material = [seed, release]
    if name is not None:
        material.append(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big"))
    return np.random.default_rng(material)


class ClippedContributions:
    """A round's stored contributions read back with each update clipped (for strategies that do not stream):
    one pass over every tensor measures each contribution's update, then `tensor` clips as it reads."""

    def __init__(self, stored: StoredContributions, global_weights: Mapping[str, torch.Tensor], norm_bound: float,
                 names: Sequence[str]) -> None:
        self._stored, self._global, self._bound = stored, global_weights, norm_bound
        squares = [0.0] * len(stored.samples)
        for name in names:
            base = global_weights[name]
            if not base.is_floating_point():
                continue
            for i, tensor in enumerate(stored.tensor(name)):
                update = (tensor.double() - base.double()).flatten()
                squares[i] += float(torch.dot(update, update))
        self._scales = [min(1.0, norm_bound / math.sqrt(s)) if s > 0 else 1.0 for s in squares]

    @property
    def samples(self) -> Sequence[int]:
        """Each contribution's sample count, in the order `tensor` returns them."""
        return self._stored.samples

    def tensor(self, name: str) -> list[torch.Tensor]:
        """Tensor `name` of every contribution, its update clipped, in `samples` order."""
        base = self._global[name]
        tensors = self._stored.tensor(name)
        if not base.is_floating_point():
            return tensors
        return [t if scale >= 1.0 else torch.sub(t, base).mul_(scale).add_(base)
                for t, scale in zip(tensors, self._scales, strict=True)]


def private(strategy: Strategy, settings: DifferentialPrivacy | None) -> Strategy:
    """The strategy wrapped for differential privacy where the round asks for it, else itself."""
    return strategy if settings is None else DifferentiallyPrivate(strategy, settings)
