"""One open round in memory, typed: what its round.start stored, and what its strategy has taken in so far."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

from apiary.component import from_json
from apiary.contracts import ObjectRef
from apiary.privacy import DifferentialPrivacy
from apiary.status import ContributionStatus
from apiary.strategies.base import Contribution, Strategy
from apiary.strategies.format import UpdateFormat
from apiary.strategies.validation import InvalidContribution
from services.aggregator.decisions import SecureRoundSpec, privacy_of, secure_of, strategy_of, update_format

RoundKey = tuple[str, int, int]  # (job, round, attempt)


@dataclass(frozen=True)
class Round:
    """A round attempt as its aggregations row says: fixed from its round.start on."""

    key: RoundKey
    shards: frozenset[int]
    min_workers: int
    weights: ObjectRef  # the global weights the round started from
    deadline: float
    traceparent: str | None  # the round's span: the parent of its aggregation span
    strategy: str
    strategy_params: Mapping[str, Any]
    update_format: UpdateFormat
    secret_digests: str  # the row's JSON text as stored: judge_sender parses it once per round
    privacy: DifferentialPrivacy | None = None  # central differential privacy around the strategy, if asked for
    secure: SecureRoundSpec | None = None  # secure aggregation, if asked for

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Round:
        """The round an aggregations row describes."""
        strategy, params = strategy_of(row)
        return cls(key=(row["job_id"], row["round"], row["attempt"]), shards=frozenset(from_json(row["shards"])),
                   min_workers=row["min_workers"],
                   weights=ObjectRef(key=row["weights_key"], size=row["weights_size"], sha256=row["weights_sha256"]),
                   deadline=row["deadline"], traceparent=row["traceparent"], strategy=strategy,
                   strategy_params=params, update_format=update_format(row),
                   secret_digests=row["secret_digests"], privacy=privacy_of(row), secure=secure_of(row))

    @property
    def digests_row(self) -> Mapping[str, Any]:
        """The part of the round's row judge_sender reads."""
        return {"secret_digests": self.secret_digests}


@dataclass
class RoundState:
    """An open round's running state: which shards have settled and its strategy's running sum. It is a cache
    of the database and storage: while `sound`, exactly what the settled shards' rows say; else it is
    recovered from them (OpenRounds.current), so a contribution is counted exactly when its row says so."""

    round: Round
    strategy: Strategy
    settled: dict[int, ContributionStatus] = field(default_factory=dict)
    # Set while a change is under way (a fold, a settling row's write): one stopped part way, by an error of any
    # kind or a cancellation, leaves the sum, or whether the row was stored, unknown: the rows then say.
    stale: bool = False

    @property
    def key(self) -> RoundKey:
        """(job, round, attempt)."""
        return self.round.key

    @property
    def sound(self) -> bool:
        """Whether the state is exactly that of the round's rows (the accepted shards' contributions summed)."""
        return not self.stale and not self.strategy.spoiled

    def take_in(self, shard: int, contribution: Contribution) -> None:
        """Fold an accepted contribution into the strategy and settle its shard; a refused one raises
        ValueError (InvalidContribution says why), the strategy saying whether the refusal spoiled its sum."""
        stale, self.stale = self.stale, True
        try:
            self.strategy.accept(contribution)
        except InvalidContribution:
            self.stale = stale  # refused whole, or the strategy says its sum is spoiled
            raise
        self.settled[shard] = ContributionStatus.ACCEPTED
        self.stale = stale

    async def settle(self, shard: int, status: ContributionStatus, write: Awaitable[int | None]) -> int | None:
        """Settle a shard without taking anything in (rejected, failed) once `write` has stored its row; what
        `write` returns (how many of the round's shards have settled)."""
        stale, self.stale = self.stale, True
        settled = await write
        self.settled[shard] = status
        self.stale = stale
        return settled
