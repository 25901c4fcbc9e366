"""The strategy seam: what every aggregation strategy does, and the registry that finds one by name.

A strategy is pure (no I/O, no bus, no database). For each round the aggregator calls `begin` with
the global model's spec and the update format, `accept` for each contribution as it arrives, then
`finish` once; `state` / `load_state` carry server state (momentum, moments, ...) as tensors, which
the aggregator stores with the round so a restart resumes exactly. The base class validates every
contribution against the round and honours the update format, so a strategy says only how it folds
(`_fold`) and what it makes of the round (`_aggregate`, or `_read_back` for one that cannot fold).

Server state outlives `begin`: restore it with `load_state` before the round's `finish` (before or
after `begin`), and store `state()` after `finish`. A strategy with `streaming = False` keeps only
sample counts while contributions arrive; its `finish` reads them back through `stored`.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from apiary.strategies import DEFAULT_STRATEGY
from apiary.strategies.format import UpdateFormat
from apiary.strategies.validation import validate
from apiary.strategies.weighted_sum import Perturb
from apiary.weights import WeightSpec

DEFAULT = DEFAULT_STRATEGY


@dataclass(frozen=True)
class Contribution:
    """One worker's result for a round: its weights, how many samples they saw, its metrics."""

    weights: Mapping[str, torch.Tensor]
    samples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    shard: int | None = None  # the shard it trained, where the aggregator knows it (secure aggregation reads it)


@dataclass(frozen=True)
class RoundResult:
    """What a round ends with: the new global weights, the samples behind them, the round's metrics."""

    weights: dict[str, torch.Tensor]
    total_samples: int
    metrics: dict[str, float]


class StoredContributions(Protocol):
    """A round's accepted contributions read back one tensor at a time, for strategies that cannot fold
    (order statistics): peak memory is K x one tensor, not K x the model."""

    @property
    def samples(self) -> Sequence[int]:
        """Each contribution's sample count, in the order `tensor` returns them."""

    def tensor(self, name: str) -> list[torch.Tensor]:
        """Tensor `name` of every contribution, in `samples` order."""


class ContributionList:
    """StoredContributions over contributions held in memory (tests, benchmarks, small rounds)."""

    def __init__(self, contributions: Sequence[Contribution]) -> None:
        self._contributions = list(contributions)

    @property
    def samples(self) -> Sequence[int]:
        """Each contribution's sample count, in the order `tensor` returns them."""
        return [c.samples for c in self._contributions]

    def tensor(self, name: str) -> list[torch.Tensor]:
        """Tensor `name` of every contribution, in `samples` order."""
        return [c.weights[name] for c in self._contributions]


class StrategyParams(BaseModel):
    """A strategy's parameters: unknown names are refused, values are checked by their constraints."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(StrategyParams):
    """The parameters of a strategy that takes none."""


class Strategy(ABC):
    """An aggregation strategy: begin a round, accept contributions, finish into new global weights."""

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    Params: ClassVar[type[BaseModel]] = NoParams
    # True for strategies whose aggregate is a mean that `perturb` reaches before anything else reads it (the
    # FedAvg family): differential privacy's noise goes there, and on the result for any other strategy.
    perturbs_mean: ClassVar[bool] = False
    # False for strategies that need every contribution at once (median, trimmed mean, Krum): they keep
    # nothing while contributions arrive, and `finish` reads them back through `stored`.
    streaming: ClassVar[bool] = True
    # True for strategies whose server state every worker needs with the round (SCAFFOLD's control variate c):
    # the aggregator announces where it is stored, and each assignment carries it as payload["server_state"].
    shares_state: ClassVar[bool] = False

    def __init__(self, params: BaseModel | None = None) -> None:
        self.params = params if params is not None else self.Params()
        self.spec: WeightSpec = {}
        self.format = UpdateFormat.FULL
        self.total_samples = 0
        self._keys: frozenset[str] | None = None
        self._metrics: list[tuple[int, Mapping[str, float]]] = []
        # Set by a privacy wrapper: changes each aggregated float mean in place (strategies with perturbs_mean).
        self.perturb: Perturb | None = None

    def check_job(self, num_shards: int, min_workers: int) -> None:
        """Raise ValueError (one line) when a job with these sizes can never meet this strategy's needs."""
        return None  # most strategies fit any job

    def population(self, shards: int) -> None:
        """Told before `begin`: how many shards the job's rounds train (N), for strategies that scale by it."""
        return None  # most strategies do not

    def needs_start_weights(self) -> bool:
        """Whether `begin` needs the round's global weights (a strategy that reads each update as it arrives)."""
        return False

    def begin(self, spec: WeightSpec, update_format: UpdateFormat,
              global_weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Start a round whose global weights have `spec` (and are `global_weights`, where
        `needs_start_weights()` says so) and whose updates come as `update_format`."""
        self.spec, self.format = spec, update_format
        self.total_samples, self._keys, self._metrics = 0, None, []
        self._begin()

    def accept(self, contribution: Contribution) -> None:
        """Validate a contribution and take it into the round, or raise InvalidContribution (why)."""
        # Values are left to `_fold`, which checks each tensor while it is in cache (one read).
        validate(self.spec, contribution.weights, contribution.samples, values=False,
                 partial=self.format is UpdateFormat.ADAPTER, expected_keys=self._keys)
        self._fold(contribution)
        self._keys = frozenset(contribution.weights)
        self._metrics.append((contribution.samples, contribution.metrics))
        self.total_samples += contribution.samples

    def wants_global_weights(self) -> bool:
        """Whether `finish` needs the round's global weights (the aggregator reads them only then)."""
        return self.format is UpdateFormat.ADAPTER

    def finish(
        self, global_weights: Mapping[str, torch.Tensor] | None = None, stored: StoredContributions | None = None
    ) -> RoundResult:
        """The round's new global weights and metrics; the round cannot accept anything afterwards.

        `stored` (the accepted contributions, in any order) is read only by strategies that do not
        stream; `global_weights` is needed where `wants_global_weights()` says so.
        """
        if self.streaming:
            update = self._aggregate(global_weights)
        elif stored is None:
            raise ValueError(f"strategy {self.name!r} reads the round's contributions back at the close: pass `stored`")
        else:
            update = self._read_back(stored, global_weights)
        if self.format is UpdateFormat.ADAPTER:
            if global_weights is None:
                raise ValueError("an adapter round needs the global weights to put its average in")
            update = merge_partial(global_weights, update)
        return RoundResult(update, self.total_samples, weighted_metrics(self._metrics))

    @property
    def spoiled(self) -> str | None:
        """Why the round's running state can no longer be used (rebuild it from the accepted ones)."""
        return None

    def state(self) -> dict[str, torch.Tensor]:
        """The server state that outlives a round, as tensors (none by default); store it before the next
        round's `finish`, which may update these tensors in place."""
        return {}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what `state` returned after an earlier round (before this round's `finish`)."""
        if state:
            raise ValueError(f"strategy {self.name!r} keeps no server state, got {sorted(state)[:3]}")

    @abstractmethod
    def _begin(self) -> None:
        """Reset the per-round running state."""

    @abstractmethod
    def _fold(self, contribution: Contribution) -> None:
        """Take a validated contribution in, checking its values (`all_finite`) as they are read."""

    @abstractmethod
    def _aggregate(self, global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The new values of the tensors the round's contributions carry (streaming strategies)."""

    def _read_back(
        self, stored: StoredContributions, global_weights: Mapping[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """The new values of the round's tensors, read back from `stored` (strategies that do not stream)."""
        raise NotImplementedError(f"strategy {self.name!r} sets streaming = False but does not read back")


class Wrapping(Strategy):
    """A strategy around another (privacy, secure aggregation): it reads each update against the round's global
    weights as it arrives and leaves the aggregate to `inner`, whose name, job checks and population it carries."""

    def __init__(self, inner: Strategy) -> None:
        super().__init__(inner.params)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # the round's strategy, as logs and failures name it

    def check_job(self, num_shards: int, min_workers: int) -> None:
        """The wrapped strategy's check."""
        self.inner.check_job(num_shards, min_workers)

    def population(self, shards: int) -> None:
        """Told to the wrapped strategy."""
        self.inner.population(shards)

    def needs_start_weights(self) -> bool:
        """Every update is read against the round's global weights."""
        return True


def weighted_metrics(items: list[tuple[int, Mapping[str, float]]]) -> dict[str, float]:
    """Average each numeric metric over contributions, weighted by their sample counts."""
    sums: dict[str, float] = {}
    weights: dict[str, int] = {}
    for samples, metrics in items:
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                sums[key] = sums.get(key, 0.0) + samples * float(value)
                weights[key] = weights.get(key, 0) + samples
    return {key: sums[key] / weights[key] for key in sums if weights[key]}


def merge_partial(base: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The global model with the averaged adapter tensors put in place."""
    return {**base, **update}


_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make a strategy findable by its name and aliases."""
    for name in (cls.name, *cls.aliases):
        if _REGISTRY.get(name, cls) is not cls:
            raise ValueError(f"strategy name {name!r} is taken by {_REGISTRY[name].__name__}")
        _REGISTRY[name] = cls
    return cls


def known() -> list[str]:
    """Every registered strategy name and alias."""
    _discover()
    return sorted(_REGISTRY)


def lookup(name: str) -> type[Strategy]:
    """The strategy class registered as `name`, or ValueError listing the known ones."""
    _discover()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def create(name: str = DEFAULT, params: Mapping[str, Any] | None = None) -> Strategy:
    """A new strategy by name with its parameters checked, or ValueError saying what was wrong."""
    cls = lookup(name)
    try:
        parsed = cls.Params.model_validate(dict(params or {}))
    except ValidationError as e:
        known_params = ", ".join(cls.Params.model_fields) or "none"
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(f"strategy {name!r}: {problems} (its parameters: {known_params})") from None
    return cls(parsed)


@functools.cache
def _discover() -> None:
    # Each strategy module registers itself on import: adding a strategy is adding a file here.
    import apiary.strategies as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
