"""Code bundles on the deployed services (RabbitMQ, PostgreSQL, S3 in moto): `apiary submit` packs a job
file's code folder and uploads it through the tracker's HTTP API into the bucket; workers, which hold no S3
credentials, fetch it by presigned URL and run an entrypoint that exists nowhere else: its fl_init_weights,
fl_train_model and fl_evaluate_model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from apiary import bundle
from apiary.weights import loads
from tests.fixtures.cluster import REPO, Cluster
from tests.toyjobs.toy import make_dataset

pytestmark = pytest.mark.slow  # each case starts a deployment of processes

TRAIN_PY = '''
import torch

def fl_init_weights(env):
    return {"w": torch.full((2,), 1.0)}

def fl_train_model(payload, out_dir, logger=None):
    weights = {k: v + 7 for k, v in payload["initial_weights"].items()}
    return {"weights": weights, "samples": 1, "metrics": {"loss": 0.5}}

def fl_evaluate_model(weights, env):
    return {"shipped_total": float(weights["w"].sum())}
'''


def test_a_job_files_code_folder_is_shipped_to_deployed_workers(cluster: Cluster, s3_server: str,
                                                                  tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "src" / "deployedtoy").mkdir(parents=True)
    (project / "src" / "deployedtoy" / "__init__.py").write_text("")
    (project / "src" / "deployedtoy" / "train.py").write_text(TRAIN_PY)
    (project / "job.json").write_text(json.dumps({
        "name": "shipped", "entrypoint": "deployedtoy.train:fl_train_model", "code": "src",
        "dataset": str(make_dataset(project / "data", 8)),
        "distributed": {"num_rounds": 2, "min_workers": 2, "max_workers": 2},
    }))
    sha256 = bundle.pack(project / "src").sha256
    cluster.start(workers=2)

    submitted = subprocess.run([sys.executable, "-m", "services.app.cli", "submit", str(project / "job.json"),
                                "--wait"], cwd=REPO, env=cluster.env(), capture_output=True, text=True, timeout=240)
    job_id = submitted.stdout.split()[0] if submitted.stdout else ""
    shown = subprocess.run([sys.executable, "-m", "services.app.cli", "status", job_id],
                           cwd=REPO, env=cluster.env(), capture_output=True, text=True, timeout=60)
    job = cluster.wait_job(job_id, timeout=60)

    assert submitted.returncode == 0, submitted.stderr[-3000:]
    assert job["status"] == "completed", job["reason"]
    bucket, _, prefix = cluster.storage_url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    stored = s3.get_object(Bucket=bucket, Key=f"{prefix}/code/{sha256}.zip")["Body"].read()
    assert bundle.sha256_of(stored) == sha256
    final = loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/jobs/{job_id}/final/model.safetensors")["Body"].read())
    assert final["w"].tolist() == [15.0, 15.0]  # fl_init_weights' 1, then 7 per round
    assert json.loads(job["metrics"])["shipped_total"] == 30.0  # fl_evaluate_model, from the bundle, on a worker
    assert f"code {sha256[:12]} (" in shown.stdout and "entrypoint deployedtoy.train:fl_train_model" in shown.stdout
    trained_by = cluster.query("SELECT DISTINCT worker_id FROM contributions WHERE job_id = $1", job_id)
    assert len(trained_by) == 2
