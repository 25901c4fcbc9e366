"""`distributed.secure_aggregation`: Flower 1.42's SecAggPlusWorkflow parameters, names and defaults, and how
they resolve against a round's number of workers."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_MODULUS = 2**32  # masks and sums are uint64: a modulus up to 2**32 leaves room for any K's carries
# The strategies whose result is a function of the weighted sum of contributions: the only ones a masked sum
# serves. Order statistics and distance-based selection need every update in the clear.
SUMMING_STRATEGIES = ("federated_averaging", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
ALIASES = ("fedavg",)  # federated_averaging's other name
NEEDS_CLEAR = {  # why a strategy cannot run on a masked sum
    "fedmedian": "takes a coordinate-wise median",
    "fedtrimmedavg": "trims each coordinate's extremes",
    "krum": "picks one update by its distances to the others",
    "multikrum": "picks updates by their distances to the others",
}


class SecureAggregation(BaseModel):
    """`distributed.secure_aggregation`: masked, quantised contributions whose sum alone the aggregator learns."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_shares: int | float = Field(description="neighbours each worker shares its secrets with, itself "
                                    "included (an int > 2, or a fraction of the round's workers; 1: all)")
    reconstruction_threshold: int | float = Field(description="shares that rebuild a secret (an int below "
                                                  "num_shares, or a fraction of num_shares)")
    max_weight: float = Field(1000.0, gt=0.0, allow_inf_nan=False, description="the largest sample count one "
                              "contribution may carry (updates are weighted by samples / max_weight)")
    clipping_range: float = Field(8.0, gt=0.0, allow_inf_nan=False, description="each weighted update value is "
                                  "clipped to [-clipping_range, clipping_range] before quantisation")
    quantization_range: int = Field(4194304, gt=1, description="values are quantised to integers in "
                                    "[0, quantization_range]")
    modulus_range: int = Field(4294967296, description="the ring of masks and sums (a power of 2, above "
                               "quantization_range times the round's workers, at most 2**32)")
    timeout: float | None = Field(None, gt=0.0, allow_inf_nan=False, description="seconds the consistency check "
                                  "waits for the survivors' signatures, and then the unmask stage for their shares "
                                  "(default 60 each); the earlier stages wait within the round's "
                                  "aggregation_timeout")

    @model_validator(mode="after")
    def _consistent(self) -> SecureAggregation:
        shares, threshold = self.num_shares, self.reconstruction_threshold
        if isinstance(shares, int) and shares != 1 and shares <= 2:
            raise ValueError(f"num_shares {shares} must be 1 (all workers) or above 2")
        if isinstance(shares, float) and not 0 < shares <= 1:
            raise ValueError(f"num_shares {shares} as a fraction must be in (0, 1]")
        if isinstance(threshold, int) and threshold < 1:
            raise ValueError(f"reconstruction_threshold {threshold} must be at least 1")
        if isinstance(threshold, float) and not 0 < threshold <= 1:
            raise ValueError(f"reconstruction_threshold {threshold} as a fraction must be in (0, 1]")
        if isinstance(shares, int) and shares > 2 and isinstance(threshold, int) and threshold >= shares:
            raise ValueError(f"reconstruction_threshold ({threshold}) must be below num_shares ({shares})")
        if self.modulus_range <= 0 or self.modulus_range & (self.modulus_range - 1):
            raise ValueError(f"modulus_range {self.modulus_range} must be a power of 2")
        if self.modulus_range > MAX_MODULUS:
            raise ValueError(f"modulus_range {self.modulus_range} must be at most 2**32")
        if self.modulus_range <= self.quantization_range:
            raise ValueError(f"modulus_range ({self.modulus_range}) must be above quantization_range "
                             f"({self.quantization_range})")
        return self

    def resolved(self, workers: int) -> Resolved:
        """The round's integer parameters for `workers` participants; ValueError (one line) where they cannot
        hold: a threshold or share count above the workers, or sums that would wrap the modulus."""
        if workers < 2:
            raise ValueError("secure aggregation needs at least 2 workers a round (max_workers >= 2): one "
                             "worker's sum is its update")
        shares = self.num_shares
        if isinstance(shares, float):
            count = round(shares * workers)
            if count < workers and count % 2 == 0:
                count += 1  # Flower's rule: an odd neighbourhood, symmetric around each worker
            count = workers if count <= 2 else count
        else:
            count = workers if shares == 1 else shares
        if count > workers:
            raise ValueError(f"num_shares ({count}) must not exceed the round's workers ({workers})")
        if count < workers and count % 2 == 0:
            count += 1
        count = min(count, workers)
        threshold = self.reconstruction_threshold
        t = max(round(threshold * count), 2) if isinstance(threshold, float) else threshold
        if t > count:
            raise ValueError(f"reconstruction_threshold ({t}) must not exceed num_shares ({count}) for "
                             f"{workers} workers")
        if workers * self.quantization_range >= self.modulus_range:
            raise ValueError(f"{workers} workers x quantization_range {self.quantization_range} would wrap "
                             f"modulus_range {self.modulus_range}: raise modulus_range or lower quantization_range")
        return Resolved(num_shares=count, threshold=t, max_weight=self.max_weight, clipping_range=self.clipping_range,
                        quantization_range=self.quantization_range, modulus_range=self.modulus_range)


@dataclass(frozen=True)
class Resolved:
    """A round's secure-aggregation parameters, as integers for its number of workers."""

    num_shares: int
    threshold: int
    max_weight: float
    clipping_range: float
    quantization_range: int
    modulus_range: int

    def error_bound(self, contributors: int, total_samples: int) -> float:
        """The largest difference, per value, between the unmasked weighted mean of `contributors` updates of
        `total_samples` samples and the plain one (apiary.secagg.quantize.mean_error_bound)."""
        from apiary.secagg.quantize import mean_error_bound

        return mean_error_bound(contributors, total_samples, self.clipping_range, self.quantization_range,
                                self.max_weight)

    @property
    def dropouts_tolerated(self) -> int:
        """How many of a worker's neighbours may drop before its secrets cannot be rebuilt."""
        return self.num_shares - self.threshold


def job_error(settings: SecureAggregation, strategy: str, max_workers: int, worker_clipping: bool | None) -> str | None:
    """Why a job's `secure_aggregation` cannot run, in one line, or None. `worker_clipping`: None without
    differential privacy, else whether it clips on the worker."""
    if strategy in NEEDS_CLEAR:
        return (f"strategy {strategy!r} {NEEDS_CLEAR[strategy]}, which needs every update in the clear: secure "
                f"aggregation takes a weighted-sum strategy ({', '.join(SUMMING_STRATEGIES)})")
    if strategy not in SUMMING_STRATEGIES and strategy not in ALIASES:
        return f"takes a weighted-sum strategy ({', '.join(SUMMING_STRATEGIES)}), not {strategy!r}"
    try:
        settings.resolved(max_workers)
    except ValueError as e:
        return str(e)
    if worker_clipping is False:
        return ("with differential_privacy needs clip_on 'worker': the aggregator never sees an update to clip "
                "(docs/security.md)")
    return None
