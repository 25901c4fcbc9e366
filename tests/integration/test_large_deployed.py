"""Large models deployed: each service and worker its own process on RabbitMQ + PostgreSQL + S3 (moto); a job whose
weights go down halved, up as int8 deltas in several parts, and are folded straight from the bucket."""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3
import pytest
import torch

from apiary import keys
from apiary.weights import loads
from apiary.wire_codec import is_encoded
from tests.fixtures.cluster import Cluster
from tests.toyjobs.toy import make_dataset

pytestmark = pytest.mark.slow  # a deployment of processes


def test_a_large_model_job_runs_deployed_with_halved_downloads_and_int8_multipart_uploads(
        cluster: Cluster, s3_server: str, tmp_path: Path) -> None:
    cluster.start(workers=2)
    job_id = f"large-{uuid.uuid4().hex[:8]}"
    request = {
        "job_id": job_id, "name": "large", "entrypoint": "tests.toyjobs.big:fl_train_model",
        "dataset": str(make_dataset(tmp_path / "data", 8)), "config": {"big_mib": 48},
        "distributed": {"num_rounds": 2, "min_workers": 2, "max_workers": 2, "aggregation_timeout": 600,
                        "fault_tolerance": 0,
                        "transfer": {"download": "bf16", "upload": "int8_blockwise", "delta": True,
                                     "part_size_mib": 5}},
    }

    cluster.publish_job(request)
    job = cluster.wait_job(job_id, timeout=300)

    assert job["status"] == "completed", job["reason"]
    bucket, _, prefix = cluster.storage_url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    listed = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/jobs/{job_id}/")["Contents"]]
    uploads = [k for k in listed if "/shard-" in k and k.endswith(".safetensors")]
    assert sorted(uploads) == sorted(f"{prefix}/{keys.contribution(job_id, 2, 1, s)}" for s in (0, 1))
    head = s3.head_object(Bucket=bucket, Key=uploads[0])
    assert head["ETag"].strip('"').endswith("-3")  # 12 MiB of int8 in parts of 5 MiB
    assert is_encoded(s3.get_object(Bucket=bucket, Key=uploads[0])["Body"].read())
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    initial = loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/{keys.global_weights(job_id, 0)}")["Body"].read())
    final = loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/{keys.final_model(job_id)}")["Body"].read())
    # Shards add 1/8 and 2/8 (4 samples each) to the bf16 copy they download; their int8 deltas go onto the
    # aggregator's fp32 weights, so the download's rounding does not accumulate.
    expected = initial["big.weight"] + 2 * 1.5 / 8
    torch.testing.assert_close(final["big.weight"], expected, rtol=0, atol=2 * (2 / 8 / 254) + 1e-6)
    assert not torch.equal(final["big.weight"], initial["big.weight"].to(torch.bfloat16).float() + 2 * 1.5 / 8)
