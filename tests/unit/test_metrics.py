"""apiary.metrics: which exporters a setting names, bounded labels, the Prometheus page, and what the recording
functions count."""

from __future__ import annotations

import logging

import pytest

from apiary import metrics
from apiary.backoff import Backoff, while_unavailable
from apiary.errors import DependencyUnavailable
from apiary.status import ContributionStatus
from services.scheduler.gauges import timeout_used
from tests.fixtures.metrics import Readings


@pytest.mark.parametrize(("value", "expected"), [
    ("", ()), ("none", ()), ("prometheus", ("prometheus",)), ("otlp", ("otlp",)),
    ("prometheus,otlp", ("prometheus", "otlp")), (" OTLP , prometheus ", ("otlp", "prometheus")),
])
def test_the_setting_names_the_exporters(value: str, expected: tuple[str, ...]) -> None:
    assert metrics.exporters(value) == expected


def test_an_unknown_exporter_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"statsd is not an exporter; use prometheus, otlp"):
        metrics.exporters("prometheus,statsd")


@pytest.mark.parametrize(("name", "label"), [
    ("assign.worker.gpu-7", "assign.worker.*"), ("apiary.assign.prefer.host-1-worker", "apiary.assign.prefer.*"),
    ("control.worker.w.1", "control.worker.*"), ("presence.pace.w9", "presence.pace.*"),
    ("assign.pool", "assign.pool"), ("worker.done", "worker.done"), ("apiary.aggregator", "apiary.aggregator"),
])
def test_per_worker_destinations_fold_into_one_label(name: str, label: str) -> None:
    assert metrics.destination(name) == label


def test_off_by_default_every_call_is_a_no_op() -> None:
    metrics.shutdown()

    metrics.contribution(ContributionStatus.ACCEPTED)
    metrics.round_ended("aggregated", 3.0)

    assert not metrics.enabled()
    with pytest.raises(LookupError, match="APIARY_METRICS=prometheus"):
        metrics.exposition()


def test_the_prometheus_page_shows_the_instruments_by_their_prometheus_names() -> None:
    metrics.shutdown()
    metrics.setup("apiary-test", "prometheus")
    try:
        metrics.message_sent("rabbitmq", "worker.done")
        metrics.round_ended("aggregated", 12.0)
        metrics.queue_depth("assign.pool", 4)

        body, content_type = metrics.exposition()
    finally:
        metrics.shutdown()

    page = body.decode()
    assert content_type.startswith("text/plain")
    assert 'messaging_client_sent_messages_total{messaging_destination_name="worker.done"' in page
    assert 'apiary_round_duration_seconds_bucket{apiary_round_status="aggregated",le="15.0"' in page
    assert 'apiary_queue_depth{messaging_destination_name="assign.pool"' in page
    assert "process_cpu_seconds_total" in page


def test_contributions_are_counted_by_outcome_with_a_refused_one_as_invalid(readings: Readings) -> None:
    for status in (ContributionStatus.ACCEPTED, ContributionStatus.ACCEPTED, ContributionStatus.REJECTED,
                   ContributionStatus.LATE):
        metrics.contribution(status)

    by_outcome = {a["apiary.contribution.outcome"]: p.value for a, p in readings.points("apiary.contributions")}

    assert by_outcome == {"accepted": 2, "invalid": 1, "late": 1}


def test_gauges_keep_the_latest_value_per_label_set(readings: Readings) -> None:
    metrics.workers_online({"own": 3, "platform": 0, "any": 1})
    metrics.workers_online({"own": 2, "platform": 0, "any": 1})
    metrics.gpu("w1", {"index": 0, "utilization": 75.0, "memory_used": 2**30})
    metrics.gpu("w1", None)  # no GPU reading this beat: the last one stands

    assert readings.gauge("apiary.workers.online", {"apiary.worker.kind": "own"}) == 2
    assert readings.gauge("apiary.gpu.utilization", {"apiary.worker.id": "w1", "apiary.gpu.index": 0}) == 0.75
    assert readings.gauge("apiary.gpu.memory.used", {"apiary.worker.id": "w1", "apiary.gpu.index": 0}) == 2**30


def test_timeout_used_is_the_most_advanced_running_round() -> None:
    rounds = [{"started_at": 100.0, "deadline": 200.0}, {"started_at": 150.0, "deadline": 160.0},
              {"started_at": 100.0, "deadline": 100.0}]  # a zero-length timeout says nothing

    assert timeout_used(rounds, now=158.0) == pytest.approx(0.8)
    assert timeout_used([], now=158.0) == 0.0


async def test_each_wait_for_a_dependency_is_counted_by_dependency(readings: Readings) -> None:
    failures = iter([DependencyUnavailable("down", dependency="the database", reason="refused")] * 2)

    async def call() -> str:
        error = next(failures, None)
        if error is not None:
            raise error
        return "done"

    result = await while_unavailable(call, Backoff(base=0.001, cap=0.002), "test", logging.getLogger("test"))

    assert result == "done"
    assert readings.total("apiary.dependency.retries", apiary__dependency="the database") == 2
