"""The `distributed.async` block of a job request: asynchronous buffered aggregation (FedBuff, Nguyen et al.,
AISTATS 2022). Workers train continuously, each from the newest global version it was handed; the aggregator
folds every arriving update into a buffer, weighted by its samples and a staleness weight, and at `buffer_size`
updates takes the server step into a new version. Pure settings and checks: no torch here (the tracker
validates requests too)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SYNC, ASYNC = "sync", "async"
Mode = Literal["sync", "async"]
DEFAULT_BUFFER = 10  # FedBuff's K where the job has at least this many workers
# The strategies whose server step is defined over a buffer of deltas: FedAvg (with FedBuff's server learning rate
# and momentum) and the FedOpt family as server optimisers. Names and aliases as the strategy registry has them.
ASYNC_STRATEGIES = ("federated_averaging", "fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
FEDAVG_NAMES = ("federated_averaging", "fedavg")


class AsyncConfig(BaseModel):
    """How versions are made in `mode: async`: the buffer size, how many shards train at once, the staleness
    weight, and FedBuff's server step."""

    model_config = ConfigDict(extra="forbid")

    buffer_size: int | None = Field(default=None, ge=1, le=100_000, description="K: updates folded into each "
                                    "new version (default: 10, or max_workers if fewer)")
    concurrency: int | None = Field(default=None, ge=1, le=10_000, description="shards training at once (default "
                                    "and at most: the number of shards, max_workers)")
    staleness_weight: Literal["constant", "polynomial", "hinge"] = Field(
        default="polynomial", description="how an update's weight falls with its staleness s (versions made since "
        "its worker's start): constant 1; polynomial (1+s)^-staleness_exponent; hinge 1 up to hinge_b, then "
        "1/(hinge_a (s-hinge_b) + 1)")
    staleness_exponent: float = Field(default=0.5, ge=0, le=100, description="polynomial: the exponent a of "
                                      "(1+s)^-a")
    hinge_a: float = Field(default=10.0, ge=0, le=1e6, description="hinge: the slope past hinge_b")
    hinge_b: int = Field(default=4, ge=0, le=100_000, description="hinge: the staleness up to which the weight is 1")
    max_staleness: int | None = Field(default=None, ge=0, le=100_000, description="updates staler than this many "
                                      "versions are rejected (recorded with why); none: no limit")
    server_learning_rate: float = Field(default=1.0, gt=0, le=1e6, description="federated_averaging: the server "
                                        "step's learning rate (FedBuff's eta_g)")
    server_momentum: float = Field(default=0.0, ge=0, lt=1, description="federated_averaging: the server step's "
                                   "momentum (0: none)")
    version_wait: float = Field(default=0.5, ge=0, le=1, description="the longest a worker that reported waits "
                                "for the next version, as a fraction of its task's time, instead of training from "
                                "the version about to be superseded: it waits when its own report filled the buffer, "
                                "or when the updates the buffer lacks are due within half that time; 0: its next "
                                "task goes out at once, as in FedBuff")

    def resolved(self, num_shards: int) -> AsyncConfig:
        """The settings with their defaults made from the job's sizes."""
        return self.model_copy(update={"buffer_size": self.buffer_size or min(DEFAULT_BUFFER, num_shards),
                                       "concurrency": self.concurrency or num_shards})

    @property
    def k(self) -> int:
        """The buffer size (of resolved settings)."""
        return self.buffer_size or DEFAULT_BUFFER

    @property
    def slots(self) -> int:
        """How many shards train at once (of resolved settings)."""
        return self.concurrency or 1


def async_errors(mode: str, settings: AsyncConfig | None, *, enabled: bool, strategy: str, num_shards: int,
                 privacy: bool) -> str | None:
    """Why a request's `distributed` block cannot run in its mode (one line), or None."""
    if mode != ASYNC:
        return "'async' settings are for mode 'async' (mode is 'sync')" if settings is not None else None
    settings = settings or AsyncConfig()
    if not enabled:
        return "mode 'async' needs federated training (enabled: true)"
    if strategy not in ASYNC_STRATEGIES:
        return (f"strategy {strategy!r} has no asynchronous form: mode 'async' works with federated_averaging, "
                "fedavgm, fedadam, fedyogi and fedadagrad")
    if privacy:
        return "differential_privacy is not available in mode 'async' (its accountant counts synchronous rounds)"
    if strategy not in FEDAVG_NAMES and (settings.server_learning_rate != 1.0 or settings.server_momentum != 0.0):
        return (f"async server_learning_rate and server_momentum are FedBuff's step for federated_averaging: "
                f"{strategy} takes its own in strategy_params")
    if settings.concurrency is not None and settings.concurrency > num_shards:
        return (f"async concurrency ({settings.concurrency}) exceeds the job's {num_shards} shards: each training "
                "task holds one shard")
    return None
