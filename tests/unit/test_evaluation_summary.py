"""Which rounds of a built-in job are evaluated (round 0, its starting model, among them when it names held-out
records), and the end-of-run summary's evaluation before and after, for built-in and user-code jobs alike."""

from __future__ import annotations

from typing import Any

from apiary.jobspec import JobSpec
from services.app.render import before_and_after, summary
from services.scheduler.evaluation import evaluation_due


def _built_in(every: int, **config: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "lm", "dataset_id": 1, "model_id": 1, "config": config,
                                   "distributed": {"num_rounds": 4, "evaluate_every": every}})


def test_a_built_in_job_with_held_out_records_evaluates_round_0_and_every_n_and_the_last() -> None:
    assert [r for r in range(5) if evaluation_due(_built_in(2, eval_dataset_id=2), r, None)] == [0, 2, 4]
    assert [r for r in range(5) if evaluation_due(_built_in(0, eval_dataset_id="2"), r, None)] == [4]
    assert [r for r in range(5) if evaluation_due(_built_in(1), r, None)] == []


def _round(index: int, evaluation: dict[str, float] | None, status: str = "aggregated") -> dict[str, Any]:
    return {"round": index, "attempt": 1, "status": status, "metrics": {}, "evaluation": evaluation}


def test_the_summary_shows_the_first_and_last_evaluated_rounds() -> None:
    built_in = [_round(0, {"exact_match": 0.0}, "initial"), _round(1, None), _round(2, {"exact_match": 0.95})]
    user_code = [_round(1, {"accuracy": 0.5}), _round(2, {"accuracy": 0.7}), _round(3, {"accuracy": 0.9})]

    assert before_and_after(built_in) == {"before": {"round": 0, "metrics": {"exact_match": 0.0}},
                                          "after": {"round": 2, "metrics": {"exact_match": 0.95}}}
    assert before_and_after(user_code) == {"before": {"round": 1, "metrics": {"accuracy": 0.5}},
                                           "after": {"round": 3, "metrics": {"accuracy": 0.9}}}
    assert before_and_after([_round(1, None), _round(2, {"accuracy": 0.7})]) == {
        "after": {"round": 2, "metrics": {"accuracy": 0.7}}}
    view = {"job_id": "j", "status": "completed", "rounds": [_round(1, None)]}
    assert summary(view, 1.0)["evaluation"] == {}
