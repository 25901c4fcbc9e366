"""Secure aggregation deployed: every service and worker its own process on its own broker user, on RabbitMQ,
PostgreSQL and S3 (moto). The broker lets the aggregator send each worker its stages and the worker read only its
own; the bucket holds masked vectors only, and the job's final weights are the plain weighted mean within the
quantisation bound."""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch

from apiary.secagg.settings import SecureAggregation
from apiary.secagg.updates import MASKED
from apiary.weights import loads
from services.app import broker_setup
from tests.fixtures.cluster import SERVICES, Cluster
from tests.toyjobs.toy import make_dataset, noise_update

pytestmark = pytest.mark.slow  # a deployment of processes

SECAGG = {"num_shares": 1, "reconstruction_threshold": 2}
WIDTH = 2000


# One worker for three shards: it trains them in turn, each trained shard's key agreement waiting beside the next.
@pytest.mark.parametrize("count", [3, 1], ids=["a-worker-per-shard", "one-worker-for-three-shards"])
def test_a_secure_job_runs_deployed_with_every_process_on_its_own_broker_user(cluster: Cluster, s3_server: str,
                                                                               tmp_path: Path, count: int) -> None:
    # Prepare
    workers, prefix = [f"worker-{i + 1}" for i in range(count)], f"apiary-test-{uuid.uuid4().hex[:10]}-"
    credentials = tmp_path / broker_setup.CREDENTIALS_FILE
    result = broker_setup.setup(cluster.exchange, "/", workers, credentials, prefix=prefix)
    passwords = broker_setup.load_credentials(credentials)

    def login(user: str) -> dict[str, str]:
        return {"APIARY_BUS_USER": user, "APIARY_BUS_PASSWORD": passwords[user]}

    try:
        for name in SERVICES:
            cluster.start_service(name, **login(f"{prefix}{name}"))
        cluster.wait_for(lambda: all(cluster.consumers(n) for n in SERVICES), 60, "the services to consume")
        for name in workers:
            cluster.start_worker(name, **login(f"{prefix}worker.{name}"))
        cluster.wait_workers(workers)
        job_id = f"secagg-{uuid.uuid4().hex[:8]}"

        # Execute
        cluster.publish_job({
            "job_id": job_id, "name": "toy", "entrypoint": "tests.toyjobs.toy:fl_train_model",
            "dataset": str(make_dataset(tmp_path / "toy", 13)),
            "config": {"mode": "ok", "noise": 0.05, "width": WIDTH},
            "distributed": {"num_rounds": 1, "min_workers": min(2, count), "max_workers": 3, "aggregation_timeout": 120,
                            "secure_aggregation": SECAGG}})
        job = cluster.wait_job(job_id, timeout=180)
    finally:
        cluster.stop_all()
        broker_setup.remove(result.users)
        broker_setup.remove_policy(cluster.exchange, "/")

    # Assert
    assert job["status"] == "completed", job["reason"]
    rows = cluster.query("SELECT shard, samples, result_key, worker_id FROM contributions WHERE job_id = $1"
                         " AND status = 'accepted' ORDER BY shard", job_id)
    bucket, _, prefix_key = cluster.storage_url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")

    def stored(key: str) -> dict[str, torch.Tensor]:
        return loads(s3.get_object(Bucket=bucket, Key=f"{prefix_key}/{key}")["Body"].read())

    start = stored(f"jobs/{job_id}/rounds/0000/global.safetensors")
    final = stored(f"jobs/{job_id}/final/model.safetensors")
    assert [r["samples"] for r in rows] == [5, 4, 4]
    assert {r["worker_id"] for r in rows} <= set(workers)
    for r in rows:
        masked = stored(r["result_key"])
        assert set(masked) == {MASKED}
        wide = masked[MASKED].numpy().view(np.uint32).astype(np.float64)[-1 - WIDTH:-1]
        plain = noise_update(1, r["shard"], "wide.weight", (WIDTH,), 0.05).double().numpy()
        assert abs(np.corrcoef(wide, plain)[0, 1]) < 0.1
    expected = start["wide.weight"].double() + sum(
        r["samples"] * (r["shard"] + 1 + noise_update(1, r["shard"], "wide.weight", (WIDTH,), 0.05).double())
        for r in rows) / 13
    bound = SecureAggregation(**SECAGG).resolved(3).error_bound(3, 13)
    assert (final["wide.weight"].double() - expected).abs().max().item() <= bound + 1e-6
