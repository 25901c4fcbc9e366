#!/usr/bin/env python
"""How many time series a deployment exports: a deployment of processes (scheduler, sharder, aggregator, tracker
and K workers on the local RabbitMQ and PostgreSQL, moto's S3) runs a job of R rounds with APIARY_METRICS=prometheus;
each process's /metrics page is then counted (one series per sample line), by process kind and by metric, and the
count extrapolated to N workers: the services' series do not grow with the fleet (no label holds a job, round,
shard or worker id, except a worker's own GPU gauges), so N workers export services + N x the largest worker page.

Usage: python scripts/metrics_series.py [--workers 3] [--rounds 3] [--fleet 100]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import uuid
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures import s3server  # noqa: E402
from tests.fixtures.cluster import SERVICES, Cluster, _free_port  # noqa: E402
from tests.fixtures.services import POSTGRES_URL, _admin_sql, delete_rabbit_namespace  # noqa: E402
from tests.toyjobs.toy import make_dataset  # noqa: E402

AMQP = os.environ.get("APIARY_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def series(page: str) -> collections.Counter[str]:
    """Series per metric family on a Prometheus page (histogram buckets, sum and count under their family)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in page.splitlines():
        if line and not line.startswith("#"):
            counts[re.sub(r"_(bucket|sum|count|created)$", "", re.split(r"[{ ]", line, maxsplit=1)[0])] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fleet", type=int, default=100, help="the fleet size to extrapolate to")
    args = parser.parse_args()
    os.environ.setdefault("APIARY_ALLOWED_ENTRYPOINTS", json.dumps(["tests.toyjobs.*"]))
    os.environ.setdefault("APIARY_DATA_ROOTS", json.dumps([tempfile.gettempdir()]))
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
    moto, endpoint = s3server.launch()
    db, exchange = f"apiary_series_{uuid.uuid4().hex[:8]}", f"apiary_series_{uuid.uuid4().hex[:8]}"
    _admin_sql(f'CREATE DATABASE "{db}"')
    try:
        with tempfile.TemporaryDirectory(prefix="apiary-series-") as tmp:
            cluster = Cluster(Path(tmp), AMQP, exchange, POSTGRES_URL.rsplit("/", 1)[0] + f"/{db}",
                              f"s3://series-{uuid.uuid4().hex[:8]}/runs", endpoint)
            workers = [f"worker-{i + 1}" for i in range(args.workers)]
            ports = {n: cluster.http_port if n == "tracker" else _free_port() for n in (*SERVICES, *workers)}
            try:
                for name in SERVICES:
                    cluster.start_service(name, APIARY_METRICS="prometheus", APIARY_METRICS_PORT=str(ports[name]))
                cluster.wait_for(lambda: all(cluster.consumers(n) for n in SERVICES), 60, "the services")
                for name in workers:
                    cluster.start_worker(name, APIARY_METRICS="prometheus", APIARY_METRICS_PORT=str(ports[name]))
                cluster.wait_workers(workers)
                job_id = cluster.publish_job({
                    "job_id": f"series-{uuid.uuid4().hex[:6]}", "name": "series",
                    "entrypoint": "tests.toyjobs.toy:fl_train_model",
                    "dataset": str(make_dataset(Path(tmp) / "data", 4 * args.workers)), "config": {"mode": "ok"},
                    "distributed": {"num_rounds": args.rounds, "min_workers": args.workers,
                                    "max_workers": args.workers, "aggregation_timeout": 600},
                })
                job = cluster.wait_job(job_id, timeout=300)
                pages = {n: httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=10).text for n, p in ports.items()}
            finally:
                cluster.stop_all()
    finally:
        delete_rabbit_namespace(AMQP, exchange)
        _admin_sql(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        moto.terminate()
    counted = {name: series(page) for name, page in pages.items()}
    per_process = {name: sum(c.values()) for name, c in counted.items()}
    services = sum(per_process[n] for n in SERVICES)
    worker_max = max(per_process[n] for n in workers)
    print(f"job {job['status']}; series per process: " + ", ".join(f"{n} {v}" for n, v in per_process.items()))
    for name in ("tracker", workers[0]):
        print(f"  {name}: " + ", ".join(f"{m} {v}" for m, v in counted[name].most_common()))
    print(f"{args.fleet} workers: {services} (services) + {args.fleet} x {worker_max} (a worker) = "
          f"{services + args.fleet * worker_max} series")
    counters = ("messaging_client_consumed_messages_total", "messaging_client_sent_messages_total")
    recorded = sum(float(line.rsplit(" ", 1)[1]) for page in pages.values() for line in page.splitlines()
                   if line.startswith(counters))
    print(f"messages counted (sent + handled, every process): {recorded:.0f}, {recorded / args.rounds:.0f} per round")
    print(json.dumps({"per_process": per_process, "fleet": args.fleet, "messages_per_round": recorded / args.rounds,
                      "total": services + args.fleet * worker_max}))


if __name__ == "__main__":
    main()
