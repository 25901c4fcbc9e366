"""Early stopping as pure functions: its settings in a job (`distributed.early_stopping`), and whether a job
whose rounds reported these metric values should stop, keeping which round."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# The round metrics the built-in (causal-LM) trainer reports: anything else is rejected before the job starts.
BUILT_IN_METRICS = ("loss", "val_loss")


class EarlyStopping(BaseModel):
    """`distributed.early_stopping`: end the job after `patience` rounds without an improvement of `metric`
    by more than `min_delta` (lower is better with mode min), keeping the best round's model (`keep_best`)."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field(default="val_loss", min_length=1, max_length=100, description="the round metric watched")
    mode: Literal["min", "max"] = Field(default="min", description="min: lower is better; max: higher is better")
    patience: int = Field(default=2, ge=1, le=100_000, description="rounds in a row without an improvement before "
                          "the job stops")
    min_delta: float = Field(default=0.0, ge=0, description="the smallest change that counts as an improvement")
    keep_best: bool = Field(default=True, description="the final model is the best round's weights")


@dataclass(frozen=True)
class Stop:
    """The job stops after `round`; `best_round` is the round whose model it keeps."""

    round: int
    best_round: int
    reason: str


def improves(value: float, best: float, rule: EarlyStopping) -> bool:
    """Whether `value` beats `best` by more than the rule's min_delta, in its direction."""
    if rule.mode == "min":
        return value < best - rule.min_delta
    return value > best + rule.min_delta


def best_round(history: Sequence[tuple[int, float]], rule: EarlyStopping) -> int | None:
    """The round (of (round, value) pairs in round order) with the best value; the earliest on a tie."""
    best: tuple[int, float] | None = None
    for round_index, value in history:
        if best is None or improves(value, best[1], rule.model_copy(update={"min_delta": 0.0})):
            best = (round_index, value)
    return None if best is None else best[0]


def decide(history: Sequence[tuple[int, float]], rule: EarlyStopping) -> Stop | None:
    """Stop once `patience` rounds in a row (of the (round, value) pairs, in round order) have not improved
    on the best value before them; else None. The model kept is the best round's (keep_best) or the last's."""
    best: tuple[int, float] | None = None
    stale = 0
    for round_index, value in history:
        if best is None or improves(value, best[1], rule):
            best, stale = (round_index, value), 0
            continue
        stale += 1
        if stale >= rule.patience:
            kept = best_round(history, rule) if rule.keep_best else round_index
            reason = (f"stopped early at round {round_index}: {rule.metric} has not improved for "
                      f"{rule.patience} round{'s' if rule.patience != 1 else ''}")
            return Stop(round_index, kept if kept is not None else round_index, reason)
    return None


def missing_metric(rule: EarlyStopping, round_index: int, metrics: Mapping[str, float]) -> str | None:
    """Why the job cannot stop early on this round's metrics (its metric is not among them), or None."""
    if rule.metric in metrics:
        return None
    named = ", ".join(sorted(metrics)) or "none"
    return (f"early_stopping.metric {rule.metric!r} is not among round {round_index}'s metrics ({named}): "
            f"name one the job's rounds report")
