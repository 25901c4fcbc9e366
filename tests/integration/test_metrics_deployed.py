"""Metrics from a deployment of processes on RabbitMQ + PostgreSQL + S3 (moto), as Prometheus scrapes them: every
process serves /metrics (the tracker on its HTTP API, the others on APIARY_METRICS_PORT), and the counts are true:
the worker.done deliveries the aggregator handled equal the contributions the database holds for a fault-free job."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_metrics_embedded import samples
from tests.fixtures.cluster import SERVICES, Cluster, _free_port
from tests.toyjobs.toy import make_dataset

pytestmark = pytest.mark.slow  # starts a deployment of processes


def scrape(port: int) -> str:
    """A process's /metrics page."""
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    response.raise_for_status()
    return response.text


def test_worker_done_handled_by_the_aggregator_equals_the_contributions_stored(cluster: Cluster,
                                                                              tmp_path: Path) -> None:
    ports = {name: cluster.http_port if name == "tracker" else _free_port() for name in (*SERVICES, "w1", "w2", "w3")}
    for name in SERVICES:
        cluster.start_service(name, APIARY_METRICS="prometheus", APIARY_METRICS_PORT=str(ports[name]))
    cluster.wait_for(lambda: all(cluster.consumers(n) for n in SERVICES), 60, "the services to consume their queues")
    for worker in ("w1", "w2", "w3"):
        cluster.start_worker(worker, APIARY_METRICS="prometheus", APIARY_METRICS_PORT=str(ports[worker]))
    cluster.wait_workers(["w1", "w2", "w3"])
    job_id = f"metrics-{uuid.uuid4().hex[:8]}"
    cluster.publish_job({
        "job_id": job_id, "name": "metrics", "entrypoint": "tests.toyjobs.toy:fl_train_model",
        "dataset": str(make_dataset(tmp_path / "toy", 12)), "config": {"mode": "ok"},
        "distributed": {"num_rounds": 3, "min_workers": 3, "max_workers": 3, "aggregation_timeout": 600,
                        "evaluate_every": 0},
    })

    job = cluster.wait_job(job_id, timeout=180)
    stored = cluster.query("SELECT status, COUNT(*) AS n FROM contributions WHERE job_id = $1 GROUP BY status", job_id)
    pages = {name: scrape(port) for name, port in ports.items()}

    assert job["status"] == "completed", job["reason"]
    assert [(r["status"], r["n"]) for r in stored] == [("accepted", 9)]
    handled = [(labels.get("error_type", ""), value)
               for labels, value in samples(pages["aggregator"], "messaging_client_consumed_messages_total")
               if labels["messaging_destination_name"] == f"{cluster.exchange}.aggregator"
               and labels["messaging_rabbitmq_destination_routing_key"] == "worker.done"]
    assert handled == [("", 9.0)]
    assert sum(v for labels, v in samples(pages["aggregator"], "apiary_contributions_total")
               if labels["apiary_contribution_outcome"] == "accepted") == 9
    sent = sum(v for name in ("w1", "w2", "w3") for labels, v in
               samples(pages[name], "messaging_client_sent_messages_total")
               if labels["messaging_destination_name"] == "worker.done" and labels["messaging_system"] == "rabbitmq")
    assert sent == 9
    assert sum(v for labels, v in samples(pages["scheduler"], "apiary_rounds_started_total")) == 3
    uploaded = [v for name in ("w1", "w2", "w3") for labels, v in samples(pages[name], "apiary_transfer_bytes_total")
                if labels["apiary_transfer_direction"] == "upload"]
    assert sum(uploaded) > 0
    # The tracker's page is on its HTTP API's port, beside the dashboard.
    assert samples(pages["tracker"], "messaging_client_consumed_messages_total")
    # The scheduler's gauges, sampled every heartbeat interval: the job completed, three workers online.

    def gauges() -> bool:
        page = scrape(ports["scheduler"])
        jobs = {labels["apiary_job_status"]: v for labels, v in samples(page, "apiary_jobs")}
        online = {labels["apiary_worker_kind"]: v for labels, v in samples(page, "apiary_workers_online")}
        return jobs.get("completed") == 1 and jobs.get("running") == 0 and online.get("any") == 3

    cluster.wait_for(gauges, 30, "the scheduler's gauges to show the completed job and 3 workers online")
    for name, page in pages.items():
        assert job_id not in page, f"{name}'s page names the job"
