"""Early stopping's decisions: when a job stops, which round it keeps, and which metrics it can use."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from apiary.early_stopping import EarlyStopping, best_round, decide, missing_metric
from apiary.jobspec import JobSpec


def _rounds(*values: float) -> list[tuple[int, float]]:
    return list(enumerate(values, start=1))


def test_stops_after_patience_rounds_without_improvement_keeping_the_best() -> None:
    # Prepare: val_loss improves until round 4, then twice not
    rule = EarlyStopping(metric="val_loss", patience=2)

    # Execute
    stop = decide(_rounds(0.9, 0.7, 0.6, 0.5, 0.55, 0.51), rule)

    # Assert
    assert stop is not None
    assert (stop.round, stop.best_round) == (6, 4)
    assert stop.reason == "stopped early at round 6: val_loss has not improved for 2 rounds"


def test_an_improvement_resets_the_count() -> None:
    rule = EarlyStopping(patience=2)
    assert decide(_rounds(0.9, 0.95, 0.8, 0.85), rule) is None


def test_min_delta_makes_a_small_improvement_count_as_none() -> None:
    rule = EarlyStopping(patience=2, min_delta=0.05)
    stop = decide(_rounds(1.0, 0.97, 0.96), rule)
    assert stop is not None and (stop.round, stop.best_round) == (3, 3)


def test_max_mode_and_keep_best_false_keeps_the_last_round() -> None:
    rule = EarlyStopping(metric="accuracy", mode="max", patience=1, keep_best=False)
    stop = decide(_rounds(0.5, 0.8, 0.7), rule)
    assert stop is not None
    assert (stop.round, stop.best_round) == (3, 3)
    assert stop.reason.endswith("accuracy has not improved for 1 round")


def test_best_round_counts_only_the_values_given_in_their_rounds() -> None:
    # Rounds 2 and 4 were evaluated (evaluate_every 2): patience counts evaluated rounds
    assert best_round([(2, 0.4), (4, 0.3), (6, 0.35)], EarlyStopping()) == 4
    assert decide([(2, 0.4), (4, 0.3), (6, 0.35)], EarlyStopping(patience=2)) is None


def test_missing_metric_names_what_the_round_reported() -> None:
    assert missing_metric(EarlyStopping(metric="val_loss"), 1, {"val_loss": 1.0}) is None
    why = missing_metric(EarlyStopping(metric="acuracy"), 3, {"loss": 0.1, "accuracy": 0.9})
    assert why == ("early_stopping.metric 'acuracy' is not among round 3's metrics (accuracy, loss): "
                   "name one the job's rounds report")


def test_the_built_in_trainer_rejects_a_metric_it_never_reports() -> None:
    request = {"name": "lm", "dataset": "d.jsonl", "model_id": 1,
               "distributed": {"early_stopping": {"metric": "accuracy"}}}
    with pytest.raises(ValidationError, match="'accuracy' is not a metric the built-in trainer reports"):
        JobSpec.model_validate(request)
    request["distributed"] = {"early_stopping": {"metric": "val_loss"}}
    assert JobSpec.model_validate(request).distributed.early_stopping == EarlyStopping()


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValidationError):
        EarlyStopping(patience=0)
    with pytest.raises(ValidationError):
        EarlyStopping.model_validate({"mode": "lowest"})
