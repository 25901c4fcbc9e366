"""Deployed mode: each service and worker its own process on RabbitMQ + PostgreSQL + S3 (moto)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest
import torch

from apiary.weights import loads
from tests.faults.support import process_alive
from tests.fixtures.cluster import REPO, Cluster
from tests.toyjobs.toy import Gates, make_dataset

pytestmark = pytest.mark.slow  # each case starts a deployment of processes or trains in a child


def _bucket_and_prefix(s3_url: str) -> tuple[str, str]:
    bucket, _, prefix = s3_url.removeprefix("s3://").partition("/")
    return bucket, prefix


def test_digits_job_runs_on_separate_processes_and_lands_in_the_bucket(cluster: Cluster, s3_server: str) -> None:
    subprocess.run([sys.executable, "examples/digits/prepare.py"], cwd=REPO, check=True, capture_output=True)
    cluster.start(workers=3)
    job_id = f"digits-{uuid.uuid4().hex[:8]}"
    request = {
        "job_id": job_id, "name": "digits-fedavg", "entrypoint": "examples.digits.train:fl_train_model",
        "dataset": str(REPO / "examples/digits/data"),
        "config": {"epochs": 1, "batch_size": 32, "learning_rate": 0.01,
                   "heldout": str(REPO / "examples/digits/heldout"), "seed": 0},
        "distributed": {"num_rounds": 5, "min_workers": 2, "max_workers": 3, "aggregation_timeout": 600,
                        "fault_tolerance": 1},
        "worker_selection": {"mode": "pool"},
    }

    cluster.publish_job(request)
    job = cluster.wait_job(job_id, timeout=300)

    assert job["status"] == "completed", job["reason"]
    metrics = json.loads(job["metrics"])
    assert metrics["accuracy"] >= 0.90
    bucket, prefix = _bucket_and_prefix(cluster.storage_url)
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    key = f"{prefix}/jobs/{job_id}/final/model.safetensors"
    final = loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert job["final_model"] == f"s3://{bucket}/{key}"
    assert all(torch.isfinite(t).all() for t in final.values())
    trained_by = {r["worker_id"] for r in cluster.query(
        "SELECT DISTINCT worker_id FROM contributions WHERE job_id = $1 AND status = 'accepted'", job_id)}
    assert trained_by <= {"worker-1", "worker-2", "worker-3"} and len(trained_by) >= 2


def test_a_worker_added_mid_job_takes_pool_assignments(cluster: Cluster, tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "toy", 16)
    cluster.start(workers=2)
    job_id = f"scale-{uuid.uuid4().hex[:8]}"
    gates = Gates(tmp_path, opened=1)  # from round 2 on, shards wait until the late worker trains one
    cluster.publish_job({
        "job_id": job_id, "name": "scale", "entrypoint": "tests.toyjobs.toy:fl_train_model",
        "dataset": str(dataset), "config": {"mode": "gated", "gate": gates.path},
        "distributed": {"num_rounds": 6, "min_workers": 2, "max_workers": 4, "aggregation_timeout": 600,
                        "evaluate_every": 0},
    })
    cluster.wait_for(lambda: cluster.query(
        "SELECT 1 FROM aggregations WHERE job_id = $1 AND round = 1 AND status = 'aggregated'", job_id),
        120, "round 1 to be aggregated")

    # Round 2's first two shards hold the two workers at their gates; the other two wait in the pool.
    cluster.start_worker("worker-late")
    cluster.wait_for(lambda: cluster.query(
        "SELECT 1 FROM workers WHERE worker_id = 'worker-late' AND state = 'training' AND job_id = $1", job_id),
        120, "the late worker to train a shard of the job")
    gates.open_through(6)
    job = cluster.wait_job(job_id, timeout=180)

    assert job["status"] == "completed", job["reason"]
    late = cluster.query(
        "SELECT round FROM contributions WHERE job_id = $1 AND worker_id = 'worker-late' AND status = 'accepted'",
        job_id)
    assert late, cluster.log("worker-late")[-2000:]
    assert min(r["round"] for r in late) >= 2


def test_pinned_shards_train_only_on_their_workers(cluster: Cluster, tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "toy", 10)
    cluster.start(workers=["site-a", "site-b", "bystander"])
    job_id = f"pinned-{uuid.uuid4().hex[:8]}"

    cluster.publish_job({
        "job_id": job_id, "name": "pinned", "entrypoint": "tests.toyjobs.toy:fl_train_model",
        "dataset": str(dataset), "config": {},
        "distributed": {"num_rounds": 3, "min_workers": 2, "max_workers": 2, "aggregation_timeout": 600},
        "worker_selection": {"mode": "pinned", "workers": ["site-a", "site-b"]},
    })
    job = cluster.wait_job(job_id, timeout=180)

    assert job["status"] == "completed", job["reason"]
    rows = cluster.query("SELECT shard, worker_id FROM contributions WHERE job_id = $1", job_id)
    assert {(r["shard"], r["worker_id"]) for r in rows} == {(0, "site-a"), (1, "site-b")}
    assert len(rows) == 6


def test_cli_submit_and_status_work_against_the_deployment(cluster: Cluster, tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "toy", 8)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({
        "name": "cli", "entrypoint": "tests.toyjobs.toy:fl_train_model", "dataset": str(dataset),
        "distributed": {"num_rounds": 2, "min_workers": 1, "max_workers": 2},
    }))
    cluster.start(workers=2)

    submitted = subprocess.run([sys.executable, "-m", "services.app.cli", "submit", str(job_file), "--wait"],
                               cwd=REPO, env=cluster.env(), capture_output=True, text=True, timeout=180)
    job_id = submitted.stdout.split()[0]
    shown = subprocess.run([sys.executable, "-m", "services.app.cli", "status", job_id, "--json"],
                           cwd=REPO, env=cluster.env(), capture_output=True, text=True, timeout=60)

    assert submitted.returncode == 0, submitted.stderr
    view = json.loads(shown.stdout)
    assert view["status"] == "completed" and view["round"] == 2
    assert [r["status"] for r in view["rounds"]] == ["aggregated", "aggregated"]


def test_cli_cancel_stops_a_running_job_and_one_not_yet_requested(cluster: Cluster, tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "toy", 8)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({
        "name": "cancel", "entrypoint": "tests.toyjobs.toy:fl_train_model", "dataset": str(dataset),
        "config": {"mode": "slow", "slow_seconds": 600},
        "distributed": {"num_rounds": 500, "min_workers": 1, "max_workers": 2},
    }))
    cluster.start(workers=2)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "services.app.cli", *args], cwd=REPO, env=cluster.env(),
                              capture_output=True, text=True, timeout=120)

    early = f"early-{uuid.uuid4().hex[:6]}"
    cancelled_early = cli("cancel", early)
    cluster.wait_for(lambda: cluster.query("SELECT 1 FROM early_cancels WHERE job_id = $1", early), 30,
                     "the scheduler to keep the early cancel")
    cli("submit", str(job_file), "--job-id", early)
    running = cli("submit", str(job_file)).stdout.strip()
    cluster.wait_for(lambda: len(cluster.query(
        "SELECT 1 FROM shard_views WHERE job_id = $1 AND state = 'training'", running)) == 2, 60,
        "both workers training the running job")
    children = [cluster.training_child(worker) for worker in ("worker-1", "worker-2")]
    stopped = cli("cancel", running, "--reason", "enough")
    late = cluster.wait_job(running, timeout=60)
    never = cluster.wait_job(early, timeout=60)
    # Its 10-minute shards are not trained on: each worker stops its training child.
    cluster.wait_for(lambda: not any(process_alive(pid) for pid in children if pid), 30,
                     "the workers to stop training the cancelled job")

    cluster.wait_for(lambda: cluster.query(
        "SELECT 1 FROM job_views WHERE job_id = $1 AND status = 'cancelled'", running), 30, "the tracker's view")
    again = cli("cancel", running)

    assert cancelled_early.returncode == 0 and stopped.returncode == 0, cancelled_early.stderr + stopped.stderr
    assert "no such job is known yet: if its request comes, it will not start" in cancelled_early.stdout
    assert stopped.stdout.strip() == f"cancel of job {running} sent"
    assert again.returncode != 0 and again.stderr.strip() == (
        f"error: job {running} already ended (cancelled): there is nothing to cancel")
    assert (late["status"], late["reason"]) == ("cancelled", "enough") and late["round"] == 1
    # The aggregator closed the running round too, rather than hold its sum until the round's timeout.
    cluster.wait_for(lambda: cluster.query(
        "SELECT 1 FROM aggregations WHERE job_id = $1 AND status = 'cancelled'", running), 30, "the aggregator")
    assert all(children), children
    assert (never["status"], never["reason"]) == ("cancelled", "cancelled by user")
    assert cluster.query("SELECT round FROM rounds WHERE job_id = $1", early) == []


def test_a_dataset_uploaded_once_is_named_by_id_or_uri(cluster: Cluster, tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "toy", 6)
    cluster.start(workers=2)
    uploaded = subprocess.run([sys.executable, "-m", "services.app.cli", "dataset", "upload", str(dataset),
                               "--name", "toy"], cwd=REPO, env=cluster.env(), capture_output=True, text=True,
                              timeout=60)
    assert uploaded.returncode == 0, uploaded.stderr
    dataset_id, uri = uploaded.stdout.split()
    base = {"entrypoint": "tests.toyjobs.toy:fl_train_model",
            "distributed": {"num_rounds": 1, "min_workers": 2, "max_workers": 2}}

    by_id = cluster.publish_job({**base, "job_id": f"by-id-{uuid.uuid4().hex[:6]}", "name": "by-id",
                                 "dataset_id": dataset_id})
    by_uri = cluster.publish_job({**base, "job_id": f"by-uri-{uuid.uuid4().hex[:6]}", "name": "by-uri",
                                  "dataset": uri})
    unknown = cluster.publish_job({**base, "job_id": f"unknown-{uuid.uuid4().hex[:6]}", "name": "unknown",
                                   "dataset_id": "0123456789ab"})

    assert uri.startswith("s3://") and uri.endswith("/toy.zip")
    assert cluster.wait_job(by_id)["status"] == "completed"
    assert cluster.wait_job(by_uri)["status"] == "completed"
    failed = cluster.wait_job(unknown)
    assert failed["status"] == "failed"
    assert "dataset_id '0123456789ab' is unknown" in failed["reason"]
