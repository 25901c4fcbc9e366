"""A personal-layers job's evaluation made of its shards' reports (services.scheduler.shard_evaluations.summary)."""

from __future__ import annotations

import pytest

from services.scheduler.evaluation import DONE, FAILED, NONE, PENDING
from services.scheduler.shard_evaluations import ShardReport, summary


def test_the_round_waits_for_every_shard() -> None:
    assert summary([ShardReport(0, DONE, {"accuracy": 1.0}), ShardReport(1, PENDING, {})]) is None


def test_the_rounds_metric_is_the_shards_mean_weighted_by_the_samples_each_scored() -> None:
    # Prepare
    reports = [ShardReport(0, DONE, {"accuracy": 0.9, "loss": 0.2, "num_samples": 30}, worker_id="w1"),
               ShardReport(1, DONE, {"accuracy": 0.5, "loss": 1.0, "num_samples": 10}, worker_id="w2"),
               ShardReport(2, FAILED, {}, "ValueError: no data", "w1")]

    # Execute
    s = summary(reports)

    # Assert: the failed shard is left out of the mean, which the others' sample counts weigh.
    assert s is not None and s.status == DONE
    assert s.metrics == pytest.approx({"accuracy": 0.8, "loss": 0.4, "num_samples": 40})
    assert set(s.shards) == {0, 1} and s.shards[1]["accuracy"] == 0.5
    assert s.workers == "w1, w2"


def test_without_num_samples_each_shard_weighs_the_same_and_only_common_metrics_are_averaged() -> None:
    s = summary([ShardReport(0, DONE, {"accuracy": 1.0, "f1": 0.5}), ShardReport(1, DONE, {"accuracy": 0.0})])
    assert s is not None and s.metrics == {"accuracy": 0.5}


def test_no_scored_shard_fails_the_evaluation_or_says_there_is_no_function() -> None:
    failed = summary([ShardReport(0, FAILED, {}, "boom"), ShardReport(1, FAILED, {}, "bang")])
    assert failed is not None and failed.status == FAILED and failed.error == "shard 0: boom"
    none = summary([ShardReport(0, NONE, {}), ShardReport(1, NONE, {})])
    assert none is not None and none.status == NONE and none.metrics == {}
