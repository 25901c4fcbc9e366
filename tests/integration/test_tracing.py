"""One trace per round: round -> per-worker assignment -> download/train/upload, and an aggregation
span linked to every contribution; on the embedded stack (in-memory exporter) and across processes
(OTLP over HTTP to a collector stand-in)."""

from __future__ import annotations

import threading
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from apiary import telemetry
from tests.fixtures.cluster import Cluster
from tests.fixtures.embedded import StackFactory, toy_request
from tests.toyjobs.toy import make_dataset

pytestmark = pytest.mark.slow  # each case starts a deployment of processes or trains in a child


@dataclass
class Span:
    """The parts of a span these tests look at, whichever exporter produced it."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    attributes: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)
    service: str = ""
    events: list[str] = field(default_factory=list)


def check_round_traces(spans: list[Span], job_id: str, rounds: int, shards: int) -> dict[str, list[Span]]:
    """Assert the round tree for every round of a job; return the spans grouped by trace."""
    by_trace: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace_id].append(span)
    round_spans = [s for s in spans if s.name.startswith("round ") and s.attributes.get("apiary.job_id") == job_id]
    assert sorted(s.attributes["apiary.round"] for s in round_spans) == list(range(1, rounds + 1))
    for root in round_spans:
        members = by_trace[root.trace_id]
        assert root.parent_id is None
        # From the pool, or (from round 2) from the queue of the worker that trained the shard before.
        # (The round's evaluation, an assignment too, may share its trace: only training ones count here.)
        assignments = [s for s in members if s.name.startswith(("assign.pool ", "assign.prefer."))
                       and s.name.endswith(" process") and s.attributes.get("apiary.task") == "train"]
        assert len(assignments) == shards
        for a in assignments:
            assert a.parent_id == root.span_id
            assert a.attributes["messaging.system"] == "rabbitmq"
            assert f'{a.attributes["messaging.rabbitmq.destination.routing_key"]} process' == a.name
            assert a.attributes["apiary.round"] == root.attributes["apiary.round"]
            assert {"apiary.job_id", "apiary.worker_id", "apiary.shard"} <= set(a.attributes)
            children = {s.name: s for s in members if s.parent_id == a.span_id}
            assert set(children) == {"download", "train", "upload"}
            assert children["train"].attributes["apiary.samples"] > 0
            assert children["upload"].attributes["apiary.bytes"] > 0
        aggregate = [s for s in members if s.name == "aggregate"]
        assert len(aggregate) == 1 and aggregate[0].parent_id == root.span_id
        assert sorted(aggregate[0].links) == sorted((a.trace_id, a.span_id) for a in assignments)
        assert aggregate[0].attributes["apiary.contributions"] == shards
    return by_trace


# ------------------------------------------------------------------ embedded


@pytest.fixture(scope="module")
def memory_exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    telemetry.setup("apiary-test", exporter=exporter)
    yield exporter
    telemetry.shutdown()


def _from_sdk(exporter: InMemorySpanExporter) -> list[Span]:
    out = []
    for s in exporter.get_finished_spans():
        ctx = s.get_span_context()
        out.append(Span(
            name=s.name, trace_id=f"{ctx.trace_id:032x}", span_id=f"{ctx.span_id:016x}",
            parent_id=f"{s.parent.span_id:016x}" if s.parent else None, attributes=dict(s.attributes or {}),
            links=[(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in s.links],
            events=[e.name for e in s.events],
        ))
    return out


async def test_each_round_is_one_trace_on_the_embedded_stack(embedded: StackFactory, toy_dataset: Path,
                                                             memory_exporter: InMemorySpanExporter) -> None:
    memory_exporter.clear()

    async with embedded(workers=3) as stack:
        job_id = await stack.submit(toy_request(toy_dataset, num_rounds=2))
        view = await stack.wait(job_id, timeout=120)

    assert view["status"] == "completed"
    check_round_traces(_from_sdk(memory_exporter), job_id, rounds=2, shards=3)


async def test_failures_show_in_the_trace(embedded: StackFactory, toy_dataset: Path,
                                          memory_exporter: InMemorySpanExporter) -> None:
    memory_exporter.clear()
    request = toy_request(toy_dataset, num_rounds=1, min_workers=1, max_workers=2)
    request["config"] = {"mode": "raise", "fail_shards": [1]}

    async with embedded(workers=2) as stack:
        view = await stack.wait(await stack.submit(request), timeout=120)

    spans = _from_sdk(memory_exporter)
    train_failed = [s for s in spans if s.name == "train" and "user_code.error" in s.events]
    aggregate = [s for s in spans if s.name == "aggregate"]
    assert view["status"] == "completed"
    assert len(train_failed) == 1 and train_failed[0].attributes["apiary.shard"] == 1
    assert "contribution.failed" in aggregate[0].events


# ------------------------------------------------------------------ deployed


class _Collector(BaseHTTPRequestHandler):
    spans: list[Span]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    self.server.spans.append(Span(  # type: ignore[attr-defined]
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex() or None,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        service=service, events=[e.name for e in s.events],
                    ))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        return


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture
def collector() -> Iterator[tuple[str, list[Span]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    server.spans = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server.spans  # type: ignore[attr-defined]
    server.shutdown()


def test_each_round_is_one_trace_across_processes(cluster: Cluster, tmp_path: Path,
                                                  collector: tuple[str, list[Span]]) -> None:
    endpoint, spans = collector
    otel = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    cluster.start(workers=["worker-1", "worker-2"], **otel)
    job_id = f"traced-{uuid.uuid4().hex[:8]}"
    cluster.publish_job({
        "job_id": job_id, "name": "traced", "entrypoint": "tests.toyjobs.toy:fl_train_model",
        "dataset": str(make_dataset(tmp_path / "toy", 8)),
        "distributed": {"num_rounds": 2, "min_workers": 2, "max_workers": 2},
    })

    job = cluster.wait_job(job_id, timeout=180)
    cluster.stop_all()

    assert job["status"] == "completed", job["reason"]
    by_trace = check_round_traces(spans, job_id, rounds=2, shards=2)
    for members in by_trace.values():
        services = {s.service for s in members}
        if any(s.name.startswith("round ") for s in members):
            assert {"apiary-scheduler", "apiary-worker", "apiary-aggregator"} <= services
