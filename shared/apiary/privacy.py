"""Central differential privacy as a job sets it (`distributed.differential_privacy`), and its accounting.

The settings take Flower 1.42's names and defaults (DifferentialPrivacyServerSideFixedClipping,
...AdaptiveClipping). Accounting: every aggregated round is one release of the Gaussian mechanism with noise
multiplier `noise_multiplier` (for adaptive clipping, the combined multiplier of the update and the count, as
Andrew et al. 2021 compose them). Apiary's rounds take every sampled shard rather than a random sample of a
population, so no sampling amplification is claimed: the event is `GaussianDpEvent(noise_multiplier)`, composed
once per round, and ε at `target_delta` is Google's `dp-accounting` RDP accountant's (the library Flower's
RdpAccountant wraps). Nothing here imports torch; `dp_accounting` is imported on first use (the `privacy` extra).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PRIVACY_EXTRA = "pip install 'apiary[privacy]'"  # what installs dp-accounting
BUDGET_REACHED = "privacy budget reached"  # the reason a job that stops at max_epsilon completes with
DEFAULT_TARGET_DELTA = 1e-5
ADAPTIVE_ONLY = frozenset({"initial_clipping_norm", "target_clipped_quantile", "clip_norm_lr", "clipped_count_stddev"})


class DifferentialPrivacy(BaseModel):
    """`distributed.differential_privacy`: clip each update, let the strategy aggregate, add Gaussian noise."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clipping: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: clip to clipping_norm; adaptive: the norm follows a quantile of update norms")
    clip_on: Literal["server", "worker"] = Field(
        "server", description="where updates are clipped: worker clips before upload, the aggregator verifies")
    noise_on: Literal["server", "worker"] = Field(
        "server", description="where the noise is added: server (to the aggregate) or worker (each adds its share "
        "before upload, so not even the aggregator sees an un-noised sum); worker takes clip_on worker")
    noise_multiplier: float = Field(ge=0.0, allow_inf_nan=False,
                                    description="noise std relative to the clipping norm (>= 1 for strong privacy)")
    clipping_norm: float | None = Field(None, gt=0.0, allow_inf_nan=False, description="fixed clipping's L2 norm")
    initial_clipping_norm: float = Field(0.1, gt=0.0, allow_inf_nan=False, description="adaptive: the first norm")
    target_clipped_quantile: float = Field(0.5, ge=0.0, le=1.0,
                                           description="adaptive: the quantile of update norms the norm moves to")
    clip_norm_lr: float = Field(0.2, gt=0.0, allow_inf_nan=False, description="adaptive: the norm's learning rate")
    clipped_count_stddev: float | None = Field(None, ge=0.0, allow_inf_nan=False,
                                               description="adaptive: the count's noise std (num_sampled_clients/20)")
    num_sampled_clients: int | None = Field(None, ge=1, le=10_000, description="updates per round (max_workers)")
    target_delta: float = Field(DEFAULT_TARGET_DELTA, gt=0.0, lt=1.0, description="the δ that ε is reported at")
    max_epsilon: float | None = Field(None, gt=0.0, allow_inf_nan=False,
                                      description="the job completes before a round that would spend more")
    # Reproducible noise for tests only: anyone who knows the seed can subtract the noise. Never set it for privacy.
    seed: int | None = Field(None, ge=0, lt=2**63, description="UNSAFE: makes the noise reproducible (tests only)")

    @model_validator(mode="after")
    def _consistent(self) -> DifferentialPrivacy:
        if self.clipping == "fixed":
            if self.clipping_norm is None:
                raise ValueError("clipping 'fixed' needs clipping_norm (the L2 norm updates are clipped to)")
            # Only a value other than the default counts: a stored spec, dumped whole, validates again.
            given = sorted(name for name in ADAPTIVE_ONLY
                           if getattr(self, name) != type(self).model_fields[name].default)
            if given:
                raise ValueError(f"{', '.join(given)}: for clipping 'adaptive' only (fixed clipping takes "
                                 "clipping_norm)")
        else:
            if self.clipping_norm is not None:
                raise ValueError("clipping_norm is for clipping 'fixed'; adaptive clipping starts from "
                                 "initial_clipping_norm")
            if self.clip_on == "worker":
                raise ValueError("clip_on 'worker' takes clipping 'fixed' (adaptive clipping on workers is not "
                                 "supported yet)")
        if self.noise_on == "worker" and self.clip_on != "worker":
            raise ValueError("noise_on 'worker' takes clip_on 'worker' (a worker noises the update it clipped)")
        if self.max_epsilon is not None and self.noise_multiplier == 0:
            raise ValueError("max_epsilon needs a noise_multiplier above 0 (without noise ε is infinite)")
        return self

    def resolved(self, max_workers: int) -> DifferentialPrivacy:
        """These settings with num_sampled_clients filled in (max_workers unless given), checked against the job."""
        sampled = self.num_sampled_clients or max_workers
        if sampled > max_workers:
            raise ValueError(f"num_sampled_clients ({sampled}) must not exceed max_workers ({max_workers}): the "
                             "noise would be calibrated for more updates than a round has")
        settings = self if self.num_sampled_clients == sampled else self.model_copy(
            update={"num_sampled_clients": sampled})
        if settings.clipping == "adaptive":
            settings.adaptive_noise()  # Flower's refusal of a noise multiplier the count's noise cannot leave room for
        return settings

    @property
    def sampled(self) -> int:
        """The number of updates a round's noise is calibrated for (resolved: max_workers by default)."""
        if self.num_sampled_clients is None:
            raise ValueError("num_sampled_clients is not resolved: call resolved(max_workers)")
        return self.num_sampled_clients

    @property
    def clipping_start(self) -> float:
        """The clipping norm of the first round."""
        return self.initial_clipping_norm if self.clipping_norm is None else self.clipping_norm

    @property
    def worker_noise_std(self) -> float:
        """noise_on worker: the std of the Gaussian noise each worker adds to its clipped update, `z * C / sqrt(m)`,
        so that the mean of m updates carries the central std `z * C / m` (0 where the server adds the noise)."""
        if self.noise_on != "worker" or self.clipping_norm is None:
            return 0.0
        return self.noise_multiplier * self.clipping_norm / math.sqrt(self.sampled)

    def adaptive_noise(self) -> tuple[float, float]:
        """(the count's noise std, the update's noise multiplier) for adaptive clipping, as Flower 1.42's
        `compute_adaptive_noise_params`: sigma_b defaults to m/20, and z_update = (z^-2 - (2 sigma_b)^-2)^-1/2
        so that the update and the count together spend what noise multiplier z does (Andrew et al. 2021)."""
        z = self.noise_multiplier
        if z == 0:
            return (self.clipped_count_stddev or 0.0), 0.0
        stddev = self.sampled / 20 if self.clipped_count_stddev is None else self.clipped_count_stddev
        if z >= 2 * stddev:
            raise ValueError(f"noise_multiplier {z:g} needs clipped_count_stddev above {z / 2:g} (it is {stddev:g}"
                             f"{', num_sampled_clients/20 by default' if self.clipped_count_stddev is None else ''}): "
                             "raise clipped_count_stddev or num_sampled_clients, or lower noise_multiplier")
        return stddev, (z ** -2 - (2 * stddev) ** -2) ** -0.5


def accounting_available() -> bool:
    """Whether dp-accounting is installed (the `privacy` extra)."""
    return importlib.util.find_spec("dp_accounting") is not None


def epsilon(noise_multiplier: float, rounds: int, target_delta: float) -> float:
    """ε at `target_delta` after `rounds` Gaussian releases of this noise multiplier (dp-accounting's RDP
    accountant, its default orders); 0 before any round, infinite without noise."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    return _epsilon(float(noise_multiplier), int(rounds), float(target_delta))


@functools.lru_cache(maxsize=1024)
def _epsilon(noise_multiplier: float, rounds: int, target_delta: float) -> float:
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_event.GaussianDpEvent(noise_multiplier), rounds)
    return float(accountant.get_epsilon(target_delta))


def rounds_within_budget(settings: DifferentialPrivacy, num_rounds: int) -> int:
    """How many of the job's `num_rounds` rounds run before the next would spend more than max_epsilon (all of
    them without a max_epsilon)."""
    if settings.max_epsilon is None:
        return num_rounds
    low, high = 0, num_rounds  # ε grows with the rounds: the last round within budget, by bisection
    while low < high:
        middle = (low + high + 1) // 2
        if epsilon(settings.noise_multiplier, middle, settings.target_delta) <= settings.max_epsilon:
            low = middle
        else:
            high = middle - 1
    return low


def spent(settings: DifferentialPrivacy, rounds: int) -> dict[str, Any]:
    """What a job has spent after `rounds` aggregated rounds: ε (None without noise), δ and the rounds."""
    value = epsilon(settings.noise_multiplier, rounds, settings.target_delta)
    return {"epsilon": value if math.isfinite(value) else None, "delta": settings.target_delta, "rounds": rounds}
