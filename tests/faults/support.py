"""What the fault cases share: toy job requests, the toy's closed-form FedAvg, and a deployment
(`Faults`, around the `cluster` fixture) that a test can read, publish into and break.

The toy's shard s adds s + 1 to every float weight and 1 to every integer one, so a round whose
accepted shards are A moves the global weights by sum(n_s * (s + 1)) / sum(n_s), s in A.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import boto3
import msgpack
import pika
import torch

from apiary import keys
from apiary.bus.base import ORIGINAL_KEY_HEADER, REASON_HEADER
from apiary.contracts import MSGPACK, Assignment, Event, ObjectRef, decode_body, encode
from apiary.strategies.base import Contribution, create
from apiary.strategies.format import UpdateFormat
from apiary.weights import dumps as dump_weights
from apiary.weights import loads as load_weights
from apiary.weights import spec_of_tensors
from tests.fixtures.cluster import REPO, Cluster
from tests.toyjobs.toy import fl_init_weights

TOY = "tests.toyjobs.toy:fl_train_model"

# Rounds: for each aggregated round in order, the accepted shards and their sample counts.
Rounds = list[dict[int, int]]


def toy_job(
    job_id: str,
    dataset: Path,
    *,
    rounds: int = 2,
    min_workers: int = 1,
    max_workers: int = 2,
    timeout: float = 120.0,
    fault_tolerance: int = 0,
    config: dict[str, Any] | None = None,
    pinned: list[str] | None = None,
) -> dict[str, Any]:
    """A job request for the toy entrypoint, the way another system would publish it."""
    request: dict[str, Any] = {
        "job_id": job_id, "name": job_id.rsplit("-", 1)[0], "entrypoint": TOY, "dataset": str(dataset),
        "config": config or {},
        "distributed": {"num_rounds": rounds, "min_workers": min_workers, "max_workers": max_workers,
                        "aggregation_timeout": timeout, "fault_tolerance": fault_tolerance},
    }
    if pinned:
        request["worker_selection"] = {"mode": "pinned", "workers": pinned}
    return request


def new_id(case: str) -> str:
    """A job id that names the case."""
    return f"{case}-{uuid.uuid4().hex[:8]}"


def process_alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def expected_weights(rounds: Rounds) -> dict[str, torch.Tensor]:
    """The toy's global weights after these rounds, from its closed form (in float64)."""
    weights = {k: v.to(torch.float64) if v.is_floating_point() else v.clone()
               for k, v in fl_init_weights({}).items()}
    for accepted in rounds:
        assert accepted, "an aggregated round has at least one accepted shard"
        step = sum(n * (s + 1) for s, n in accepted.items()) / sum(accepted.values())
        for tensor in weights.values():
            tensor.add_(step if tensor.is_floating_point() else 1)
    return weights


def replayed_weights(strategy: str, params: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The toy's final weights under a strategy, as an undisturbed run computes them: each round's
    accepted contributions (`rows`, the aggregator's in the order recorded) replayed through the same
    strategy, its server state carried from round to round."""
    weights = fl_init_weights({})
    state: dict[str, torch.Tensor] = {}
    for round_index in sorted({r["round"] for r in rows}):
        aggregator = create(strategy, params)
        aggregator.begin(spec_of_tensors(weights), UpdateFormat.FULL)
        aggregator.load_state(state)
        for row in rows:
            if row["round"] == round_index and row["status"] == "accepted":
                returned = {k: v.clone().add_(row["shard"] + 1 if v.is_floating_point() else 1)
                            for k, v in weights.items()}
                aggregator.accept(Contribution(returned, row["samples"]))
        weights = aggregator.finish(weights).weights
        state = {k: v.clone() for k, v in aggregator.state().items()}
    return weights


def assert_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str:
    """Same names, shapes and dtypes as the toy's; values equal up to float32 rounding. Returns
    a line for the outcome table.

    One contribution counted twice, or one from the wrong round, moves a value by at least 1/N of
    a whole step (N: the samples in a round), far above the tolerance.
    """
    assert set(actual) == set(expected)
    error = 0.0
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, name
        if want.is_floating_point():
            assert got.dtype == torch.float32, name
            assert torch.allclose(got.to(torch.float64), want, rtol=0, atol=1e-5), (name, got, want)
            error = max(error, float((got.to(torch.float64) - want).abs().max()))
        else:
            assert torch.equal(got, want), (name, got, want)
    bias = actual["layer.bias"].tolist()
    return f"weights exact (bias {[round(b, 4) for b in bias]}, max error {error:.0e})"


class Faults:
    """A deployment under test: read its tables and bucket, publish into its exchange."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.bucket, _, self.prefix = cluster.storage_url.removeprefix("s3://").partition("/")
        self.s3 = boto3.client("s3", endpoint_url=cluster.s3_endpoint, region_name="us-east-1")

    # ---------------------------------------------------------------- reading

    def query(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        """Rows from the deployment's database."""
        return self.cluster.query(sql, *args)

    def shard_sizes(self, job_id: str) -> dict[int, int]:
        """Each shard's sample count, as the sharder wrote it (waits until the job is sharded)."""
        job = self.cluster.wait_for(lambda: (j := self.cluster.job(job_id)) and j["shards"] and j, 60,
                                    f"job {job_id} to be sharded")
        return {s["index"]: s["num_samples"] for s in json.loads(job["shards"])}

    def contributions(self, job_id: str) -> list[dict[str, Any]]:
        """Every report the aggregator recorded for the job, in arrival order."""
        return self.query("SELECT * FROM contributions WHERE job_id = $1 ORDER BY seq", job_id)

    def accepted(self, job_id: str) -> dict[tuple[int, int], dict[int, int]]:
        """(round, attempt) -> {shard: samples} of the accepted contributions."""
        out: dict[tuple[int, int], dict[int, int]] = {}
        for row in self.contributions(job_id):
            if row["status"] == "accepted":
                out.setdefault((row["round"], row["attempt"]), {})[row["shard"]] = row["samples"]
        return out

    def check_exact(self, job_id: str, rounds: Rounds) -> tuple[str, int]:
        """Assert the final weights are the closed-form FedAvg of `rounds` and that no contribution
        was counted twice; return the weights line for the table and the double-count (0)."""
        line = assert_weights(self.final_weights(job_id), expected_weights(rounds))
        double = self.double_counted(job_id)
        assert double == 0, f"{double} contribution(s) counted twice"
        return line, double

    def double_counted(self, job_id: str) -> int:
        """Contributions counted more than once: extra accepted rows per (round, attempt, shard),
        plus extra aggregated attempts per round."""
        extra_rows = self.query(
            "SELECT COALESCE(SUM(n - 1), 0) AS extra FROM (SELECT COUNT(*) AS n FROM contributions"
            " WHERE job_id = $1 AND status = 'accepted' GROUP BY round, attempt, shard) c", job_id)
        extra_rounds = self.query(
            "SELECT COALESCE(SUM(n - 1), 0) AS extra FROM (SELECT COUNT(*) AS n FROM aggregations"
            " WHERE job_id = $1 AND status = 'aggregated' GROUP BY round) a", job_id)
        return int(extra_rows[0]["extra"]) + int(extra_rounds[0]["extra"])

    def aggregations(self, job_id: str) -> list[dict[str, Any]]:
        """The aggregator's rounds of a job, in order."""
        return self.query("SELECT * FROM aggregations WHERE job_id = $1 ORDER BY round, attempt", job_id)

    def rounds(self, job_id: str) -> list[dict[str, Any]]:
        """The scheduler's rounds of a job, in order."""
        return self.query("SELECT * FROM rounds WHERE job_id = $1 ORDER BY round, attempt", job_id)

    def wait_aggregation(self, job_id: str, round_index: int, status: str = "aggregated", *, attempt: int = 1,
                         timeout: float = 120) -> dict[str, Any]:
        """Wait until the aggregator has closed (or opened, with status 'open') a round attempt."""
        return dict(self.cluster.wait_for(lambda: self.query(
            "SELECT * FROM aggregations WHERE job_id = $1 AND round = $2 AND attempt = $3 AND status = $4",
            job_id, round_index, attempt, status), timeout, f"round {round_index}.{attempt} {status}")[0])

    def wait_training(self, worker_id: str, job_id: str, round_index: int, timeout: float = 60) -> int:
        """Wait until the worker's heartbeat says it trains a shard of this round; return the shard."""
        rows = self.cluster.wait_for(lambda: self.query(
            "SELECT shard FROM workers WHERE worker_id = $1 AND state = 'training' AND job_id = $2 AND round = $3",
            worker_id, job_id, round_index), timeout, f"{worker_id} to train round {round_index} of {job_id}")
        return int(rows[0]["shard"])

    def object(self, key: str) -> bytes:
        """An object of the deployment's storage, by its storage key."""
        return bytes(self.s3.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read())

    def global_weights(self, job_id: str, round_index: int) -> dict[str, torch.Tensor]:
        """The global weights the aggregator stored after a round."""
        return load_weights(self.object(keys.global_weights(job_id, round_index)))

    def final_weights(self, job_id: str) -> dict[str, torch.Tensor]:
        """The job's final model from the bucket."""
        return load_weights(self.object(keys.final_model(job_id)))

    def alive(self) -> dict[str, bool]:
        """Which processes of the deployment still run."""
        return {name: p.poll() is None for name, p in self.cluster.processes.items()}

    def status_cli(self, job_id: str) -> tuple[dict[str, Any], str]:
        """`apiary status JOB --json` (parsed) and what `apiary status JOB` shows an operator."""
        def run(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "services.app.cli", "status", job_id, *extra], cwd=REPO,
                                  env=self.cluster.env(COLUMNS="400"), capture_output=True, text=True,
                                  timeout=60, check=True)
        shown = run()
        return json.loads(run("--json").stdout), shown.stdout + shown.stderr

    # ---------------------------------------------------------------- writing

    def publish(self, routing_key: str, body: bytes, *, content_type: str = MSGPACK,
                message_id: str | None = None, url: str | None = None) -> str:
        """Publish raw bytes into the exchange with pika, as any other client could; return the id. With
        `url`, as that URL's broker user, stamping its name as the message's (broker-validated) user_id."""
        message_id = message_id or uuid.uuid4().hex
        user_id = unquote(urlsplit(url).username or "") or None if url else None
        connection = pika.BlockingConnection(pika.URLParameters(url or self.cluster.amqp_url))
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            channel.basic_publish(
                exchange=self.cluster.exchange, routing_key=routing_key, body=body, mandatory=True,
                properties=pika.BasicProperties(content_type=content_type, delivery_mode=2,
                                                message_id=message_id, user_id=user_id),
            )
        finally:
            connection.close()
        return message_id

    def publish_event(self, event: Event, routing_key: str | None = None, *, url: str | None = None) -> str:
        """Publish an event as msgpack under its routing key (as `url`'s broker user, if given)."""
        return self.publish(routing_key or event.routing_key, encode(event), url=url)

    def put_object(self, key: str, data: bytes) -> ObjectRef:
        """Store bytes under a storage key; return their claim check."""
        self.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)
        return ObjectRef(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())

    def put_weights(self, key: str, weights: dict[str, torch.Tensor]) -> ObjectRef:
        """Store weights as safetensors under a storage key."""
        return self.put_object(key, dump_weights(weights))

    def assignments(self, queue: str) -> list[Assignment]:
        """Take every assignment waiting in one of the deployment's queues (`assign.worker.<id>`): what a
        worker with that id would be given, its one-time secret included."""
        return [Assignment.model_validate(decode_body(body, properties.content_type))
                for properties, body in self._drain(f"{self.cluster.exchange}.{queue}")]

    def _drain(self, queue: str) -> list[tuple[pika.BasicProperties, bytes]]:
        """Take every message waiting in a broker queue (by its full name): properties and body."""
        out = []
        connection = pika.BlockingConnection(pika.URLParameters(self.cluster.amqp_url))
        try:
            channel = connection.channel()
            while True:
                method, properties, body = channel.basic_get(queue, auto_ack=True)
                if method is None:
                    return out
                out.append((properties, body))
        finally:
            connection.close()

    def tap(self, routing_key: str) -> str:
        """A queue of the test's own bound to `routing_key`, receiving a copy of each such message from now
        on (read it with `tapped`); it goes with the exchange's namespace."""
        name = f"{self.cluster.exchange}.tap.{uuid.uuid4().hex[:8]}"
        connection = pika.BlockingConnection(pika.URLParameters(self.cluster.amqp_url))
        try:
            channel = connection.channel()
            channel.queue_declare(name, durable=False, auto_delete=False)
            channel.queue_bind(name, self.cluster.exchange, routing_key)
        finally:
            connection.close()
        return name

    def tapped(self, tap: str) -> list[dict[str, Any]]:
        """Take the messages a tap holds, each decoded, with its raw `body`."""
        return [{**decode_body(body, properties.content_type), "body": body}
                for properties, body in self._drain(tap)]

    def dead_letters(self) -> list[dict[str, Any]]:
        """Take every message from the dead-letter queue: id, original routing key, reason, body."""
        return [{"message_id": properties.message_id,
                 "routing_key": (properties.headers or {}).get(ORIGINAL_KEY_HEADER),
                 "reason": (properties.headers or {}).get(REASON_HEADER), "body": body}
                for properties, body in self._drain(f"{self.cluster.exchange}.dead")]


def msgpack_of(value: Any) -> bytes:
    """Any value as msgpack (for bodies that are valid msgpack but not a valid event)."""
    return bytes(msgpack.packb(value, use_bin_type=True))
