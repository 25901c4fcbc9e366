"""services.tracker.experiments: what each event means for an experiment tracker, and a sink that fails retried in
the background without the tracker ever waiting for it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from apiary.backoff import Backoff
from apiary.contracts import JobCompleted, JobFailed, ObjectRef, RoundAggregated, RoundEvaluated, WorkerDone
from services.tracker.experiments import Experiments, Record, RunEnded, RunStarted, Scalars, records_of
from tests.fixtures.metrics import Readings

REF = ObjectRef(key="jobs/j1/rounds/0001/global.safetensors", size=10, sha256="0" * 64)


def test_a_job_request_starts_a_run_with_its_config_and_distributed_settings_as_params() -> None:
    request = {"job_id": "j1", "name": "digits", "config": {"epochs": 2, "opt": {"lr": 0.1}, "tags": ["a", "b"]},
               "distributed": {"num_rounds": 3, "min_workers": 2}}

    (record,) = records_of("job.requested", request, 1.0)

    assert record == RunStarted("j1", "digits", {"config.epochs": "2", "config.opt.lr": "0.1",
                                                 "config.tags": '["a", "b"]', "distributed.num_rounds": "3",
                                                 "distributed.min_workers": "2"})


def test_rounds_evaluations_and_workers_become_scalars_at_their_round() -> None:
    aggregated = RoundAggregated(job_id="j1", round=2, attempt=1, weights=REF, contributors=[0, 1], total_samples=9,
                                 metrics={"loss": 0.5, "accuracy": 0.9, "nan": float("nan")})
    evaluated = RoundEvaluated(job_id="j1", round=2, attempt=1, worker_id="w1", metrics={"accuracy": 0.8})
    done = WorkerDone(job_id="j1", round=2, attempt=1, worker_id="w-7", shard=1, result=REF, samples=4,
                      metrics={"loss": 0.7})

    assert records_of("round.aggregated", aggregated, 5.0) == [
        Scalars("j1", 2, {"loss": 0.5, "accuracy": 0.9, "contributors": 2.0}, 5.0)]
    assert records_of("round.evaluated", evaluated, 5.0) == [Scalars("j1", 2, {"eval/accuracy": 0.8}, 5.0)]
    assert records_of("worker.done", done, 5.0) == [Scalars("j1", 2, {"worker/w-7/loss": 0.7}, 5.0)]


def test_a_job_end_ends_its_run_with_the_final_model_or_why() -> None:
    completed = JobCompleted(job_id="j1", rounds_completed=3, final_model="s3://b/jobs/j1/final/model.safetensors")
    cancelled = JobFailed(job_id="j2", reason="stopped by alice", cancelled=True)

    assert records_of("job.completed", completed, 0.0) == [
        RunEnded("j1", "completed", "s3://b/jobs/j1/final/model.safetensors", None)]
    assert records_of("job.failed", cancelled, 0.0) == [RunEnded("j2", "cancelled", None, "stopped by alice")]
    assert records_of("worker.heartbeat", object(), 0.0) == []


class FlakySink:
    """Fails its first `failures` writes (its backend is down), blocking each until `release` is set."""

    name = "flaky"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.written: list[Record] = []
        self.calls = 0
        self.release = threading.Event()

    def write(self, records: Sequence[Record]) -> None:
        self.calls += 1
        self.release.wait(10)
        if self.calls <= self.failures:
            raise ConnectionError("tracking server unreachable")
        self.written.extend(records)

    def close(self) -> None:
        pass


async def test_a_failing_sink_is_retried_in_the_background_and_its_backlog_reported(readings: Readings) -> None:
    sink = FlakySink(failures=2)
    experiments = Experiments([sink], retry=Backoff(base=0.01, cap=0.02))
    experiments.start()
    events = [RoundAggregated(job_id="j1", round=r, attempt=1, weights=REF, contributors=[0], total_samples=1,
                              metrics={"loss": 1.0 / r}) for r in range(1, 4)]

    for r, event in enumerate(events, 1):
        experiments.hear("round.aggregated", event, float(r))  # returns at once: the sink is still blocked

    assert experiments.backlog("flaky") == 3
    assert readings.gauge("apiary.exporter.backlog", {"apiary.exporter": "flaky"}) == 3
    sink.release.set()
    assert await experiments.drain(timeout=10)
    await experiments.close()
    assert [r.step for r in sink.written if isinstance(r, Scalars)] == [1, 2, 3]
    assert readings.total("apiary.exporter.failures", apiary__exporter="flaky") == 2
    assert readings.gauge("apiary.exporter.backlog", {"apiary.exporter": "flaky"}) == 0


async def test_no_sink_means_nothing_is_kept() -> None:
    experiments = Experiments([])

    experiments.hear("job.completed", JobCompleted(job_id="j", rounds_completed=1, final_model="x"), 0.0)

    assert await experiments.drain(timeout=0.1)
    await asyncio.sleep(0)
