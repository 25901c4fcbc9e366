"""Dependencies that blink mid-round (issue 22): PostgreSQL restarted or unreachable, RabbitMQ
restarted, S3 frozen or shedding load. The job must lose nothing: every round aggregated from all
its shards before its deadline, nothing dead-lettered, weights exact. Each case also reports the
job's extra time over the outage's length, against the same job undisturbed (goal: <= 5 s).

Every deployment here reaches PostgreSQL through a TCP proxy and S3 through an HTTP front of the
test's, so the undisturbed job and the disturbed ones run the same path.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from pprint import pformat
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, ReadTimeoutError

from tests.faults.support import Faults, new_id, toy_job
from tests.fixtures.cluster import Cluster, standalone_cluster
from tests.fixtures.s3front import Mode, S3Front
from tests.fixtures.services import POSTGRES_URL, rabbitmqctl
from tests.fixtures.tcpproxy import TcpProxy
from tests.toyjobs.toy import make_dataset

# One worker runs the module under pytest-xdist, so its undisturbed baseline is measured once.
pytestmark = pytest.mark.xdist_group("outages")

Record = Callable[[str, str, str, int], None]

ROUNDS, SHARDS, SAMPLES = 3, 3, 15
# Bounded, and well past the longest outage: a round that closes at its deadline lost a shard.
ROUND_TIMEOUT = 60.0
EXTRA_GOAL = 5.0
# Shard 0 trains a little longer, so the outage begun at round 2's first contribution catches the
# others reporting and shard 0 still training.
SLOW = {"mode": "slow", "slow_seconds": 2, "fail_shards": [0]}


@dataclass
class Fronts:
    """What a deployment reaches its database and storage through."""

    database: TcpProxy
    storage: S3Front

    def env(self, cluster: Cluster) -> dict[str, str]:
        """The settings that point a deployment's processes at the fronts."""
        parts = urlsplit(cluster.database_url)
        netloc = f"{parts.username}@{self.database.address}" if parts.username else self.database.address
        return {"APIARY_DATABASE_URL": urlunsplit(parts._replace(netloc=netloc)),
                "APIARY_S3_ENDPOINT_URL": self.storage.endpoint}


@contextmanager
def fronted(cluster: Cluster) -> Iterator[Fronts]:
    """A database proxy and a storage front for this deployment, both gone afterwards."""
    database = urlsplit(cluster.database_url)
    with TcpProxy(database.hostname or "127.0.0.1", database.port or 5432) as proxy, \
            S3Front(cluster.s3_endpoint) as front:
        yield Fronts(proxy, front)


def run_job(faults: Faults, fronts: Fronts, data: Path, case: str,
            during_round_2: Callable[[], None] = lambda: None) -> tuple[str, dict[str, Any], float]:
    """Start the deployment, publish the job and, once round 2's first contribution is recorded,
    run `during_round_2`; return the job id, its final row and its wall time from publication."""
    cluster = faults.cluster
    cluster.start(workers=SHARDS, **fronts.env(cluster))
    job_id = new_id(case)
    started = time.monotonic()
    cluster.publish_job(toy_job(job_id, data, rounds=ROUNDS, max_workers=SHARDS, timeout=ROUND_TIMEOUT,
                                config=SLOW))
    cluster.wait_for(lambda: faults.query("SELECT 1 FROM contributions WHERE job_id = $1 AND round = 2", job_id),
                     ROUNDS * ROUND_TIMEOUT, "round 2's first contribution", interval=0.1)
    during_round_2()
    job = cluster.wait_job(job_id, timeout=ROUNDS * ROUND_TIMEOUT + 60, interval=0.1)
    return job_id, job, time.monotonic() - started


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, rabbit_url: str, s3_server: str) -> float:
    """The wall time of the module's job undisturbed, on a deployment of its own (fronts included)."""
    tmp = tmp_path_factory.mktemp("baseline")
    with standalone_cluster(tmp, rabbit_url, s3_server) as cluster, fronted(cluster) as fronts:
        _, job, seconds = run_job(Faults(cluster), fronts, make_dataset(tmp / "toy", SAMPLES), "baseline")
    assert job["status"] == "completed", job["reason"]
    return seconds


# ------------------------------------------------------------------------- the outages


def _pg_ctl(action: str) -> None:
    version = next(Path("/etc/postgresql").iterdir()).name
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", action], check=True,
                   capture_output=True, timeout=120)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def restart_postgres(fronts: Fronts) -> None:
    """`pg_ctlcluster ... restart`: the server shuts down, cutting every session, and comes back."""
    _pg_ctl("restart")


def postgres_unreachable(fronts: Fronts) -> None:
    """15 s of refused connections (open ones cut) between the deployment and PostgreSQL: long enough for the
    services' reconnect waits to grow to their cap (0.25 s doubling to 8 s)."""
    fronts.database.down()
    try:
        time.sleep(15)  # the outage itself, not a wait for anything
    finally:
        fronts.database.up()


def restart_rabbitmq(fronts: Fronts) -> None:
    """`rabbitmqctl stop_app`, 3 s, `start_app`: every connection and channel is closed meanwhile."""
    rabbitmqctl("stop_app")
    try:
        time.sleep(3)
    finally:
        rabbitmqctl("start_app")
        rabbitmqctl("await_startup")


def s3_unanswering(fronts: Fronts) -> None:
    """5 s of S3 accepting requests and answering none (they are answered when it thaws)."""
    fronts.storage.hold()
    try:
        time.sleep(5)
    finally:
        fronts.storage.resume()


def s3_slow_down(fronts: Fronts) -> None:
    """5 s of S3 answering 503 SlowDown to every request."""
    fronts.storage.slow_down()
    try:
        time.sleep(5)
    finally:
        fronts.storage.resume()


@pytest.fixture
def restored() -> Iterator[None]:
    """Whatever a case did, PostgreSQL and RabbitMQ run again afterwards (other tests share them)."""
    yield
    if not _listening(urlsplit(POSTGRES_URL).port or 5432):
        _pg_ctl("start")
    if not _listening(5672):
        rabbitmqctl("start_app")
        rabbitmqctl("await_startup")


OUTAGES = {
    "postgres restarted": restart_postgres,
    "postgres unreachable 15 s": postgres_unreachable,
    "rabbitmq restarted": restart_rabbitmq,
    "s3 unanswering 5 s": s3_unanswering,
    "s3 answering 503 for 5 s": s3_slow_down,
}


# Restarting PostgreSQL or RabbitMQ cuts every other test's sessions too: those cases run alone (`serial`); the
# others blink fronts of this deployment's own.
SHARED = {"postgres restarted", "rabbitmq restarted"}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.replace(" ", "-"),
                                               marks=[pytest.mark.serial] if c in SHARED else [])
                                  for c in OUTAGES])
def test_a_dependency_blinking_mid_round_loses_nothing(
        case: str, faults: Faults, toy_data: Callable[[int], Path], baseline: float, restored: None,
        outcome: Record) -> None:
    outage = OUTAGES[case]
    lasted = 0.0
    with fronted(faults.cluster) as fronts:

        def blink() -> None:
            nonlocal lasted
            began = time.monotonic()
            outage(fronts)
            lasted = time.monotonic() - began

        job_id, job, seconds = run_job(faults, fronts, toy_data(SAMPLES), case.split()[0], blink)
        met = {"postgres unreachable": fronts.database.cut,
               "s3": fronts.storage.counts[Mode.HOLD] + fronts.storage.counts[Mode.SLOW_DOWN]}

    sizes = faults.shard_sizes(job_id)
    accepted = faults.accepted(job_id)
    observed = {
        "status": (job["status"], job["reason"]),
        "rounds": [(a["round"], a["attempt"], a["status"], sorted(accepted.get((a["round"], a["attempt"]), {})),
                    "before its deadline" if a["closed_at"] < a["deadline"] else "at its deadline")
                   for a in faults.aggregations(job_id)],
        "dead letters": [(d["routing_key"], d["reason"]) for d in faults.dead_letters()],
    }
    assert observed == {
        "status": ("completed", None),
        "rounds": [(r, 1, "aggregated", list(range(SHARDS)), "before its deadline") for r in range(1, ROUNDS + 1)],
        "dead letters": [],
    }, pformat(observed, width=200)
    assert all(n for what, n in met.items() if case.startswith(what)), f"the outage met nothing: {met}"
    weights, double = faults.check_exact(job_id, [sizes] * ROUNDS)
    extra = seconds - baseline - lasted
    outcome(f"{case}, mid-round 2",
            f"every round aggregated from all {SHARDS} shards before its deadline; nothing dead-lettered;"
            f" extra time <= {EXTRA_GOAL:.0f} s",
            f"{job['status']}; {ROUNDS} rounds x {SHARDS} shards, none lost or timed out; outage {lasted:.1f} s,"
            f" job {seconds:.1f} s vs {baseline:.1f} s undisturbed: extra {extra:+.1f} s"
            f"{' (over the goal)' if extra > EXTRA_GOAL else ''}; {weights}", double)


# ------------------------------------------------------------------------- the fronts themselves


def test_the_database_proxy_refuses_while_down_and_serves_again_on_its_port() -> None:
    async def select_one(port: int) -> int:
        conn = await asyncpg.connect(POSTGRES_URL.replace(f":{urlsplit(POSTGRES_URL).port}", f":{port}"),
                                     timeout=5)
        try:
            return int(await conn.fetchval("SELECT 1"))
        finally:
            await conn.close()

    upstream = urlsplit(POSTGRES_URL)
    with TcpProxy(upstream.hostname or "127.0.0.1", upstream.port or 5432) as proxy:
        first = asyncio.run(select_one(proxy.port))
        proxy.down()
        with pytest.raises(OSError):
            asyncio.run(select_one(proxy.port))
        proxy.up()
        again = asyncio.run(select_one(proxy.port))

    assert (first, again) == (1, 1)


def test_the_s3_front_passes_sheds_and_holds(s3_server: str) -> None:
    with S3Front(s3_server) as front:
        s3 = boto3.client("s3", endpoint_url=front.endpoint, region_name="us-east-1",
                          config=Config(retries={"total_max_attempts": 1}, read_timeout=1, connect_timeout=1))
        bucket = new_id("s3front")
        s3.create_bucket(Bucket=bucket)
        s3.put_object(Bucket=bucket, Key="k", Body=b"v" * 1000)
        front.slow_down()
        with pytest.raises(ClientError) as shed:
            s3.head_object(Bucket=bucket, Key="k")
        front.hold()
        with pytest.raises(ReadTimeoutError):
            s3.get_object(Bucket=bucket, Key="k")
        front.resume()
        body = s3.get_object(Bucket=bucket, Key="k")["Body"].read()

    assert shed.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert body == b"v" * 1000
    assert front.counts == {Mode.PASS: 3, Mode.SLOW_DOWN: 1, Mode.HOLD: 1}
