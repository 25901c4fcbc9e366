"""Deployed (each service and worker its own process, RabbitMQ, PostgreSQL, S3): a job's code runs only in
workers' training children; the scheduler, sharder, aggregator and tracker never import it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.cluster import SERVICES, Cluster
from tests.fixtures.processes import parent
from tests.toyjobs.toy import make_dataset

pytestmark = pytest.mark.slow  # each case starts a deployment of processes or trains in a child

WITNESS = "TOYJOB_WITNESS"  # tests.toyjobs.witness appends a line here on import and on every call


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_a_whole_job_runs_its_code_only_in_workers_training_children(cluster: Cluster, tmp_path: Path) -> None:
    # Prepare: every process gets the witness file; the job's module leaves a line wherever it is imported
    witness = tmp_path / "witness.jsonl"
    dataset = make_dataset(tmp_path / "toy", 8)
    cluster.start(workers=2, **{WITNESS: str(witness)})
    job_id = f"witness-{uuid.uuid4().hex[:8]}"

    # Execute: init, 2 rounds, an evaluation after each
    cluster.publish_job({
        "job_id": job_id, "name": "witness", "entrypoint": "tests.toyjobs.witness:fl_train_model",
        "dataset": str(dataset), "config": {},
        "distributed": {"num_rounds": 2, "min_workers": 2, "max_workers": 2, "aggregation_timeout": 600},
    })
    job = cluster.wait_job(job_id, timeout=180)

    # Assert
    records = _records(witness)
    services = {cluster.processes[name].pid for name in SERVICES}
    workers = {cluster.processes[name].pid for name in ("worker-1", "worker-2")}
    assert job["status"] == "completed", job["reason"]
    assert {r["event"] for r in records} == {"import", "init", "train", "evaluate"}, records
    assert not [r for r in records if r["pid"] in services or r["ppid"] in services], records
    # A training child's parent is its worker's fork server (apiary.trainers.process), whose parent is the worker.
    assert all(parent(r["ppid"]) in workers and r["process"].startswith("apiary-worker-") for r in records), records
    assert all("worker" in r["argv"] and "serve" not in r["argv"] for r in records), records
    # The tracker may record the last evaluation just after the scheduler completed the job.
    evaluated = cluster.wait_for(lambda: (rows := cluster.query(
        "SELECT round, evaluation FROM round_views WHERE job_id = $1 AND evaluation IS NOT NULL ORDER BY round",
        job_id)) and len(rows) == 2 and rows, 30, "the tracker to record both evaluations")
    assert [(r["round"], "weight_sum" in json.loads(r["evaluation"])) for r in evaluated] == [(1, True), (2, True)]
