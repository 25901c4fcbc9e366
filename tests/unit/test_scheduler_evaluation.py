"""The scheduler's decisions about evaluations: which rounds are evaluated, where tasks go, when a job ends
and with which round's model."""

from __future__ import annotations

from typing import Any

from apiary.jobspec import JobSpec
from services.scheduler.evaluation import (
    DONE,
    FAILED,
    PENDING,
    Ending,
    Evaluation,
    ending,
    evaluation_due,
    final_metrics,
    history,
    judged_by_evaluation,
    may_be_kept,
    may_end,
    task_worker,
)


def _spec(**distributed: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "t", "entrypoint": "pkg.train", "dataset": "d",
                                   "distributed": {"num_rounds": 6, "max_workers": 3, **distributed}})


def test_rounds_are_evaluated_every_n_and_after_the_last() -> None:
    assert [r for r in range(1, 7) if evaluation_due(_spec(), r, None)] == [1, 2, 3, 4, 5, 6]
    assert [r for r in range(1, 7) if evaluation_due(_spec(evaluate_every=4), r, True)] == [4, 6]
    assert [r for r in range(1, 7) if evaluation_due(_spec(evaluate_every=0), r, None)] == [6]


def test_no_evaluation_once_the_module_is_known_to_have_none_nor_for_a_built_in_job() -> None:
    assert not evaluation_due(_spec(), 6, False)
    built_in = JobSpec.model_validate({"name": "lm", "dataset": "d.jsonl", "model_id": 1})
    assert not evaluation_due(built_in, 1, None)
    assert not judged_by_evaluation(built_in, None)


def test_tasks_go_to_the_pool_or_to_one_of_the_jobs_own_workers() -> None:
    assert task_worker(_spec(), {"w1"}) is None
    pinned = _spec(min_workers=1).model_copy(update={"worker_selection": JobSpec.model_validate(
        {"name": "t", "entrypoint": "m", "dataset": "d",
         "worker_selection": {"mode": "pinned", "workers": ["a", "b"]}}).worker_selection})
    assert task_worker(pinned, {"b"}) == "b"  # the online one
    assert task_worker(pinned, set()) == "a"  # none online: the first waits for it
    assert {task_worker(pinned, {"a", "b"}, turn) for turn in (0, 1)} == {"a", "b"}


def test_mixed_jobs_evaluate_on_their_own_workers_first() -> None:
    spec = JobSpec.model_validate({"name": "t", "entrypoint": "m", "dataset": "d",
                                   "worker_selection": {"mode": "mixed", "worker_ids": [7],
                                                        "parsyn_worker_ids": [9]}})
    assert task_worker(spec, {"7", "9"}) == "7"


def test_the_job_completes_once_its_last_round_and_evaluations_are_in() -> None:
    spec = _spec(num_rounds=2)
    rounds = {1: {"loss": 1.0}, 2: {"loss": 0.5}}
    pending = [Evaluation(1, DONE, {"acc": 0.5}), Evaluation(2, PENDING, {})]
    assert ending(spec, 2, True, rounds, pending) is None
    done = [Evaluation(1, DONE, {"acc": 0.5}), Evaluation(2, DONE, {"acc": 0.7})]
    assert ending(spec, 2, True, rounds, done) == Ending(2, 2)
    assert ending(spec, None, True, {1: rounds[1]}, done[:1]) is None  # the last round has not aggregated


def test_only_a_rule_or_the_last_round_can_end_a_job_after_a_round() -> None:
    # Prepare: a job without an early-stopping rule and one with, each with any round's metrics and evaluations
    plain, stopping = _spec(), _spec(early_stopping={"metric": "loss", "patience": 1})
    histories = [({}, []), ({1: {"loss": 0.5}, 2: {"loss": 0.9}}, [Evaluation(1, DONE, {"acc": 0.5})]),
                 ({1: {"loss": 1.0}}, [Evaluation(1, FAILED, {}, "x"), Evaluation(2, PENDING, {})])]
    # Execute / Assert: where may_end says no, ending has nothing to say whatever the history
    assert not may_end(plain, False)
    assert all(ending(plain, None, by, rounds, evaluations) is None
               for rounds, evaluations in histories for by in (True, False))
    assert may_end(plain, True) and may_end(stopping, False) and may_end(stopping, True)


def test_a_failed_last_evaluation_is_the_reason_of_a_completed_job() -> None:
    evaluations = [Evaluation(1, FAILED, {}, "RuntimeError: boom (train.py:3 in fl_evaluate_model)")]
    end = ending(_spec(num_rounds=1), 1, True, {1: {"loss": 1.0}}, evaluations)
    assert end == Ending(1, 1, reason="evaluation of round 1 failed: RuntimeError: boom "
                                      "(train.py:3 in fl_evaluate_model)")


def test_early_stopping_waits_for_pending_evaluations_and_skips_failed_ones() -> None:
    spec = _spec(early_stopping={"metric": "acc", "mode": "max", "patience": 1})
    rounds = {r: {"loss": 1.0} for r in (1, 2, 3)}
    # Round 2's evaluation pending: round 3's worse value waits for it
    waiting = [Evaluation(1, DONE, {"acc": 0.9}), Evaluation(2, PENDING, {}), Evaluation(3, DONE, {"acc": 0.1})]
    assert ending(spec, None, True, rounds, waiting) is None
    # Round 2's evaluation failed: round 3 is the next one judged
    failed = [Evaluation(1, DONE, {"acc": 0.9}), Evaluation(2, FAILED, {}, "x"), Evaluation(3, DONE, {"acc": 0.1})]
    assert ending(spec, None, True, rounds, failed) == Ending(
        3, 1, reason="stopped early at round 3: acc has not improved for 1 round")


def test_without_evaluations_early_stopping_reads_the_aggregated_metrics() -> None:
    spec = _spec(early_stopping={"metric": "loss", "patience": 2})
    rounds = {1: {"loss": 0.5}, 2: {"loss": 0.6}, 3: {"loss": 0.7}}
    assert history(spec.distributed.early_stopping, False, rounds, []) == ([(1, 0.5), (2, 0.6), (3, 0.7)], None)
    assert ending(spec, None, False, rounds, []) == Ending(3, 1, reason="stopped early at round 3: loss has not "
                                                                        "improved for 2 rounds")


def test_a_metric_no_round_reports_fails_the_job() -> None:
    spec = _spec(early_stopping={"metric": "accuracy"})
    end = ending(spec, None, True, {1: {"loss": 1.0}}, [Evaluation(1, DONE, {"acc": 0.5})])
    assert end is not None and end.failure == ("early_stopping.metric 'accuracy' is not among round 1's metrics "
                                               "(acc): name one the job's rounds report")


def test_keep_best_picks_the_best_round_at_the_end_too() -> None:
    spec = _spec(num_rounds=3, early_stopping={"metric": "acc", "mode": "max", "patience": 5})
    evaluations = [Evaluation(1, DONE, {"acc": 0.5}), Evaluation(2, DONE, {"acc": 0.8}),
                   Evaluation(3, DONE, {"acc": 0.7})]
    rounds = {r: {"loss": 1.0 / r} for r in (1, 2, 3)}
    end = ending(spec, 3, True, rounds, evaluations)
    assert end == Ending(3, 2)
    assert final_metrics(2, rounds, evaluations) == {"loss": 0.5, "acc": 0.8}


def test_the_rounds_a_job_may_still_keep_are_its_latest_its_unjudged_and_its_best() -> None:
    rounds = {r: {"loss": 1.0} for r in (1, 2, 3, 4, 5)}
    evaluations = [Evaluation(1, DONE, {"acc": 0.5}), Evaluation(2, DONE, {"acc": 0.8}),
                   Evaluation(3, DONE, {"acc": 0.7}), Evaluation(4, PENDING, {})]
    # No rule: only the latest round's model can be the final one.
    assert may_be_kept(_spec(), True, rounds, evaluations) == {5}
    # keep_best: the best judged round (2), and every round not judged yet (4 waits for its evaluation, 5 for its).
    best = _spec(early_stopping={"metric": "acc", "mode": "max", "patience": 5})
    assert may_be_kept(best, True, rounds, evaluations) == {2, 4, 5}
    # Without keep_best a stop keeps the round it judged last: only rounds not judged yet may still be kept.
    last = _spec(early_stopping={"metric": "acc", "mode": "max", "patience": 5, "keep_best": False})
    assert may_be_kept(last, True, rounds, evaluations) == {4, 5}


def test_tasks_get_at_least_ten_minutes_whatever_the_rounds_timeout() -> None:
    from services.scheduler.evaluation import task_timeout

    assert task_timeout(_spec(aggregation_timeout=8)) == 600.0
    assert task_timeout(_spec(aggregation_timeout=3600)) == 3600.0
