"""APIARY_METRICS=otlp: the same instruments pushed as OTLP (HTTP/protobuf here) to a collector stand-in, with
OpenTelemetry's own variables, and flushed when the process shuts metrics down."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from apiary import metrics


class _Collector(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        request = ExportMetricsServiceRequest()
        request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, request))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_metrics_are_pushed_over_otlp_with_the_standard_variables(collector: ThreadingHTTPServer,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.server_port}")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")  # only the flush at shutdown
    metrics.shutdown()
    metrics.setup("apiary-aggregator", "otlp")

    metrics.message_handled("rabbitmq", "apiary.aggregator", "worker.done", "ack", 0.0)
    metrics.contribution("accepted")
    metrics.round_ended("aggregated", 4.0)
    metrics.shutdown()  # flushes

    (path, request), *_ = collector.requests  # type: ignore[attr-defined]
    assert path == "/v1/metrics"
    (resource,) = request.resource_metrics
    assert {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"] == "apiary-aggregator"
    found = {m.name: m for scope in resource.scope_metrics for m in scope.metrics}
    assert {"messaging.client.consumed.messages", "messaging.process.duration", "apiary.contributions",
            "apiary.round.duration"} <= set(found)
    (point,) = found["messaging.client.consumed.messages"].sum.data_points
    assert point.as_double == 1 and found["messaging.client.consumed.messages"].sum.is_monotonic
    assert {a.key: a.value.string_value for a in point.attributes}["messaging.rabbitmq.destination.routing_key"] == (
        "worker.done")
