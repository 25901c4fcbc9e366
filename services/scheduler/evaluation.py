"""A job's evaluations and its end, as pure functions: which rounds are evaluated, which worker an init or
evaluate task goes to, what early stopping sees of the rounds so far, and when (and with which round's
model) the job completes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from apiary.early_stopping import EarlyStopping, best_round, decide, missing_metric
from apiary.jobspec import JobSpec
from apiary.privacy import BUDGET_REACHED, epsilon, rounds_within_budget

PENDING, DONE, FAILED, NONE = "pending", "done", "failed", "none"  # an evaluation's status; none: no function
# The least time an init or evaluate task is given (the user's code, and a worker to take it): a round's
# aggregation_timeout may be seconds, while a first call imports the job's libraries.
MIN_TASK_TIMEOUT = 600.0


@dataclass(frozen=True)
class Evaluation:
    """One round's evaluation as the scheduler stored it."""

    round: int
    status: str
    metrics: dict[str, float]
    error: str | None = None


@dataclass(frozen=True)
class Ending:
    """The job ends: completed after `last` (the last round aggregated), keeping round `kept`'s model; a
    `reason` when it stopped early (or its final evaluation failed), or `failure` when it must fail."""

    last: int
    kept: int
    reason: str | None = None
    failure: str | None = None


def evaluation_due(spec: JobSpec, round_index: int, evaluates: bool | None) -> bool:
    """Whether the round's global model is evaluated on a worker: a user-code job whose module has (or may
    have: not yet known) fl_evaluate_model, or a built-in job with held-out records (`eval_dataset_id`),
    every `evaluate_every` rounds and after the last; a built-in job's round 0 (its starting model) too,
    unless evaluate_every is 0."""
    built_in = spec.built_in
    if evaluates is False or (built_in is not None and built_in.eval_dataset_id is None):
        return False
    every = spec.distributed.evaluate_every
    if round_index == 0:
        return built_in is not None and every > 0
    return round_index == planned_rounds(spec) or (every > 0 and round_index % every == 0)


def planned_rounds(spec: JobSpec) -> int:
    """How many rounds the job runs: num_rounds, or fewer where its privacy budget (max_epsilon) ends it first."""
    settings, num_rounds = spec.distributed.differential_privacy, spec.distributed.num_rounds
    return num_rounds if settings is None else rounds_within_budget(settings, num_rounds)


def budget_reason(spec: JobSpec, last_round: int) -> str | None:
    """Why a job with a privacy budget ends after `last_round`, before its num_rounds; None if it did not."""
    settings = spec.distributed.differential_privacy
    if settings is None or settings.max_epsilon is None or last_round >= spec.distributed.num_rounds:
        return None
    now = epsilon(settings.noise_multiplier, last_round, settings.target_delta)
    after = epsilon(settings.noise_multiplier, last_round + 1, settings.target_delta)
    return (f"{BUDGET_REACHED}: ε {now:.4g} after round {last_round}, round {last_round + 1} would spend {after:.4g} "
            f"> max_epsilon {settings.max_epsilon:g} (δ {settings.target_delta:g})")


def task_timeout(spec: JobSpec) -> float:
    """Seconds an init or evaluate task may take before the scheduler stops waiting for it."""
    return max(spec.distributed.aggregation_timeout, MIN_TASK_TIMEOUT)


def task_worker(spec: JobSpec, online: set[str], turn: int = 0) -> str | None:
    """The worker an init or evaluate task goes to: None for the pool; in a pinned or mixed job one of its
    own workers (the listed own ones first, in mixed mode), an online one if any, taking turns by `turn`."""
    selection = spec.worker_selection
    listed = [str(w) for w in selection.worker_ids] if selection.mode == "mixed" else []
    candidates = listed or selection.pinned
    if not candidates:
        return None
    up = [w for w in candidates if w in online] or candidates
    return up[turn % len(up)]


def judged_by_evaluation(spec: JobSpec, evaluates: bool | None) -> bool:
    """Whether early stopping reads evaluation metrics (a job evaluated every N rounds) rather than the
    rounds' aggregated training metrics (a built-in job, a module without fl_evaluate_model, or
    evaluate_every 0)."""
    return spec.trainer is None and evaluates is not False and spec.distributed.evaluate_every > 0


def history(rule: EarlyStopping, by_evaluation: bool, rounds: Mapping[int, Mapping[str, float]],
            evaluations: Sequence[Evaluation]) -> tuple[list[tuple[int, float]], str | None]:
    """The (round, value) pairs early stopping sees, in round order, up to the first evaluation still
    pending (rounds judged after it wait for it); and why the job must fail if a round lacks the metric."""
    seen: list[tuple[int, float]] = []
    if not by_evaluation:
        for round_index in sorted(rounds):
            if (why := missing_metric(rule, round_index, rounds[round_index])) is not None:
                return seen, why
            seen.append((round_index, float(rounds[round_index][rule.metric])))
        return seen, None
    for e in sorted(evaluations, key=lambda e: e.round):
        if e.status == PENDING:
            break
        if e.status != DONE:
            continue  # a failed evaluation says nothing about the metric
        if (why := missing_metric(rule, e.round, e.metrics)) is not None:
            return seen, why
        seen.append((e.round, float(e.metrics[rule.metric])))
    return seen, None


def may_end(spec: JobSpec, last_round_aggregated: bool) -> bool:
    """Whether `ending` can end the job once a round aggregated: an early-stopping rule may stop it, or the round
    was its last (a job without a rule ends only after its last round)."""
    return spec.distributed.early_stopping is not None or last_round_aggregated


def ending(spec: JobSpec, last_round: int | None, by_evaluation: bool, rounds: Mapping[int, Mapping[str, float]],
           evaluations: Sequence[Evaluation]) -> Ending | None:
    """Whether the job ends now, and how: stopped early, failed for a metric no round reports, or completed
    once its last round aggregated and no evaluation is pending; None while it goes on."""
    rule = spec.distributed.early_stopping
    if rule is not None:
        seen, why = history(rule, by_evaluation, rounds, evaluations)
        if why is not None:
            return Ending(max(rounds, default=0), max(rounds, default=0), failure=why)
        stop = decide(seen, rule)
        if stop is not None:
            return Ending(max(rounds, default=stop.round), stop.best_round, reason=stop.reason)
    if last_round is None or any(e.status == PENDING for e in evaluations):
        return None
    kept = last_round
    if rule is not None and rule.keep_best:
        seen, _ = history(rule, by_evaluation, rounds, evaluations)
        kept = best_round(seen, rule) or last_round
    final = next((e for e in evaluations if e.round == last_round), None)
    reason = f"evaluation of round {last_round} failed: {final.error}" if final and final.status == FAILED else None
    reason = "; ".join(why for why in (budget_reason(spec, last_round), reason) if why) or None
    return Ending(last_round, kept, reason=reason)


def may_be_kept(spec: JobSpec, by_evaluation: bool, rounds: Mapping[int, Mapping[str, float]],
                evaluations: Sequence[Evaluation]) -> set[int]:
    """The aggregated rounds whose model the job may still end with (so their shard states are kept): the latest
    round; with early stopping every round its rule has not judged yet, and the best judged one (keep_best)."""
    latest = max(rounds, default=0)
    rule = spec.distributed.early_stopping
    if rule is None:
        return {latest}
    seen, _ = history(rule, by_evaluation, rounds, evaluations)
    judged = max((r for r, _ in seen), default=0)
    kept = {r for r in rounds if r > judged} | {latest}
    best = best_round(seen, rule) if rule.keep_best else None
    return kept | ({best} if best is not None else set())


def final_metrics(kept: int, rounds: Mapping[int, Mapping[str, float]],
                  evaluations: Sequence[Evaluation]) -> dict[str, Any]:
    """The job's metrics: the kept round's aggregated training metrics, its evaluation's over them."""
    evaluated = next((e.metrics for e in evaluations if e.round == kept and e.status == DONE), {})
    return {**rounds.get(kept, {}), **evaluated}
