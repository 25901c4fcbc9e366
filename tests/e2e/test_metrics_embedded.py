"""Metrics and experiment tracking on the embedded stack: the tracker's /metrics page counts as many worker.done
deliveries handled by the aggregator as the database holds contributions; a job becomes an MLflow run (on a real
sqlite:/// tracking store) and TensorBoard event files in its folder, read back with their own readers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from apiary import metrics
from tests.fixtures.embedded import StackFactory, toy_request
from tests.fixtures.metrics import Readings


def samples(page: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of one metric on a Prometheus text page: (labels, value)."""
    out = []
    for line in page.splitlines():
        if line.startswith(f"{name}{{") or line.startswith(f"{name} "):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            out.append((labels, float(line.rsplit(" ", 1)[1])))
    return out


@pytest.fixture
def prometheus() -> Iterator[None]:
    """Metrics on, with a /metrics page, for one test."""
    metrics.shutdown()
    metrics.setup("apiary-test", "prometheus")
    yield
    metrics.shutdown()


async def test_worker_done_handled_equals_contributions_stored(embedded: StackFactory, toy_dataset: Path,
                                                               prometheus: None) -> None:
    async with embedded(workers=3) as stack:
        url = await stack.tracker.start_http(port=0)
        job_id = await stack.submit(toy_request(toy_dataset, num_rounds=3))
        view = await stack.wait(job_id, timeout=120)
        stored = await stack.ports.db.fetchval("SELECT COUNT(*) FROM contributions WHERE job_id = $1", job_id)
        async with httpx.AsyncClient() as client:
            page = (await client.get(f"{url}/metrics")).text

    assert view["status"] == "completed"
    done = [(labels, value) for labels, value in samples(page, "messaging_client_consumed_messages_total")
            if labels["messaging_destination_name"] == "aggregator"
            and labels["messaging_rabbitmq_destination_routing_key"] == "worker.done"]
    assert [labels.get("error_type", "") for labels, _ in done] == [""]  # no requeue, no dead letter
    assert done[0][1] == stored == 9
    accepted = {labels["apiary_contribution_outcome"]: value for labels, value in
                samples(page, "apiary_contributions_total")}
    assert accepted == {"accepted": 9.0}
    ended = {labels["apiary_round_status"]: v for labels, v in samples(page, "apiary_rounds_ended_total")}
    assert ended == {"aggregated": 3.0}
    assert not any(job_id in line for line in page.splitlines()), "no job id in any label"


async def test_a_job_becomes_an_mlflow_run_and_tensorboard_scalars(embedded: StackFactory, toy_dataset: Path,
                                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root (./mlruns) for a sqlite store
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    request = toy_request(toy_dataset, num_rounds=2)
    request["config"] = {"mode": "ok", "lr": 0.1}

    async with embedded(workers=2, mlflow_tracking_uri=uri, tensorboard=True) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        assert await stack.tracker.experiments.drain(timeout=60)

    assert view["status"] == "completed"
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("apiary")
    (run,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.`apiary.job_id` = '{job_id}'")
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "toy"
    assert run.data.params["config.lr"] == "0.1" and run.data.params["distributed.num_rounds"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]
    worker_losses = [k for k in run.data.metrics if re.fullmatch(r"worker/worker-\d/loss", k)]
    assert worker_losses
    assert run.data.tags["apiary.final_model"] == view["final_model"]
    assert "apiary/final_model.json" in [a.path for a in client.list_artifacts(run.info.run_id, "apiary")]

    folder = tmp_path / ".apiary" / "storage" / "jobs" / job_id / "tensorboard"
    events = EventAccumulator(str(folder))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2]
    assert {e.step for k in events.Tags()["scalars"] if k.startswith("worker/") for e in events.Scalars(k)} == {1, 2}


async def test_an_mlflow_server_that_is_down_neither_fails_nor_holds_up_the_job(
        embedded: StackFactory, toy_dataset: Path, readings: Readings) -> None:
    async with embedded(workers=2, mlflow_tracking_uri="http://127.0.0.1:9") as stack:  # nothing listens there
        job_id = await stack.submit(toy_request(toy_dataset, num_rounds=2))
        view = await stack.wait(job_id, timeout=120)
        backlog = stack.tracker.experiments.backlog("mlflow")

    assert view["status"] == "completed"
    assert backlog > 0  # the run's records wait for the server, retried in the background
    assert readings.total("apiary.exporter.failures", apiary__exporter="mlflow") >= 1
    assert readings.gauge("apiary.exporter.backlog", {"apiary.exporter": "mlflow"}) == backlog
