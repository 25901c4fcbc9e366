"""Per-shard state on the deployed stack (issue 41): SCAFFOLD with personal layers on the digits example, each
service and worker its own process on RabbitMQ, PostgreSQL and S3 (moto). States travel by presigned URL only,
the scheduler and aggregator keep references, and the final model lands with each shard's personal layers."""

from __future__ import annotations

import subprocess
import sys
import uuid

import boto3
import pytest
import torch

from apiary.weights import loads
from tests.fixtures.cluster import REPO, Cluster

pytestmark = pytest.mark.slow  # starts a deployment of processes


def test_scaffold_with_personal_layers_keeps_state_per_shard_in_the_bucket(cluster: Cluster, s3_server: str) -> None:
    subprocess.run([sys.executable, "examples/digits/prepare.py"], cwd=REPO, check=True, capture_output=True)
    cluster.start(workers=3)
    job_id = f"scaffold-{uuid.uuid4().hex[:8]}"
    cluster.publish_job({
        "job_id": job_id, "name": "digits-scaffold", "entrypoint": "examples.digits.train:fl_train_model",
        "dataset": str(REPO / "examples/digits/data"),
        "config": {"epochs": 1, "batch_size": 32, "learning_rate": 0.01,
                   "heldout": str(REPO / "examples/digits/heldout"), "seed": 0},
        "distributed": {"num_rounds": 3, "min_workers": 3, "max_workers": 3, "aggregation_timeout": 600,
                        "strategy": "scaffold", "personal_layers": ["fc.*"], "evaluate_every": 0},
        "split": {"strategy": "label_skew", "alpha": 0.1, "seed": 0},
    })

    job = cluster.wait_job(job_id, timeout=300)

    assert job["status"] == "completed", job["reason"]
    shards = cluster.query("SELECT shard, round, state_key FROM shard_states WHERE job_id = $1 ORDER BY shard", job_id)
    server = cluster.query("SELECT round, state_key FROM server_states WHERE job_id = $1", job_id)
    assert [(r["shard"], r["round"]) for r in shards] == [(0, 3), (1, 3), (2, 3)]
    assert [r["round"] for r in server] == [3]
    bucket, _, prefix = cluster.storage_url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")

    def stored(key: str) -> dict[str, torch.Tensor]:
        return loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read())

    initial = stored(f"jobs/{job_id}/rounds/0000/global.safetensors")
    final = stored(f"jobs/{job_id}/final/model.safetensors")
    control = stored(server[0]["state_key"])
    assert torch.equal(final["fc.weight"], initial["fc.weight"])  # the head is personal: never aggregated
    assert not torch.equal(final["conv1.weight"], initial["conv1.weight"])
    assert any(bool(t.abs().max() > 0) for t in control.values())  # c moved
    heads = []
    for shard in range(3):
        kept = stored(f"jobs/{job_id}/final/shards/shard-{shard:04d}.safetensors")
        assert {"personal.fc.weight", "personal.fc.bias", "scaffold.c_i.conv1.weight"} <= set(kept)
        heads.append(kept["personal.fc.weight"])
    assert not torch.equal(heads[0], heads[1]) and not torch.equal(heads[1], heads[2])
