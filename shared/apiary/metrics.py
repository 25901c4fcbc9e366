"""Operational metrics: one set of OpenTelemetry instruments for every process, exported as settings say.

`APIARY_METRICS` chooses the exporters: `prometheus` (a `/metrics` page: the tracker's on its HTTP API, every
other process's on `APIARY_METRICS_PORT`), `otlp` (pushed every `OTEL_METRIC_EXPORT_INTERVAL` ms to
`OTEL_EXPORTER_OTLP_ENDPOINT`, as the traces are), both (`prometheus,otlp`), or none (the default: every call
below is then a no-op instrument's). Each metric is documented in docs/metrics.md.

Labels stay bounded: no job id, round or shard on any series. Per-worker queues and routing keys
(`assign.worker.<id>`, ...) are folded into one destination (`assign.worker.*`); the only per-worker series are
the GPU gauges, which a worker's own process exports.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, NoOpMeterProvider, Observation

log = logging.getLogger("apiary.metrics")

METER_NAME = "apiary"
EXPORTERS = ("prometheus", "otlp")
# Seconds: a message's handling (milliseconds to a training round), a round, an aggregation.
_HANDLING_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 60.0, 300.0)
_ROUND_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
_AGGREGATION_BUCKETS = (0.01, 0.05, 0.25, 1.0, 5.0, 15.0, 60.0, 300.0)
# Destinations named per worker, folded into one series each.
_PER_WORKER = re.compile(r"^(.*?\b(?:assign\.worker|assign\.prefer|control\.worker|presence\.pace))\..+$")


def exporters(value: str) -> tuple[str, ...]:
    """The exporters an `APIARY_METRICS` value names (`""` or `none`: none); ValueError names a bad one."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in value.replace("+", ",").split(",") if n.strip()))
    if names in ((), ("none",)):
        return ()
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ValueError(f"APIARY_METRICS={value!r}: {', '.join(unknown)} is not an exporter; "
                         f"use prometheus, otlp, both (prometheus,otlp) or none")
    return names


@functools.lru_cache(maxsize=512)
def destination(name: str) -> str:
    """A queue or routing key as a label: one per worker folded into `<prefix>.*`."""
    return _PER_WORKER.sub(r"\1.*", name)


Attributes = tuple[tuple[str, str], ...]


class LocalCounter:
    """A counter kept in a dict here and read by an observable counter when the exporter collects: the SDK's own
    `add` costs tens of microseconds a call (it cleans and hashes the attributes every time), too much for every
    message; this costs a dict update. Call from one thread (the event loop)."""

    def __init__(self, meter: Meter, name: str, unit: str, description: str) -> None:
        self.values: dict[Attributes, float] = {}
        meter.create_observable_counter(name, callbacks=[self._observe], unit=unit, description=description)

    def add(self, amount: float, attributes: Attributes) -> None:
        """Count `amount` for these attributes (a tuple made once per label set: see `_sent_attributes`)."""
        self.values[attributes] = self.values.get(attributes, 0.0) + amount

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(value, dict(attributes)) for attributes, value in list(self.values.items())]


class Instruments:
    """Every instrument Apiary records, made by one meter (a no-op one while metrics are off)."""

    def __init__(self, meter: Meter) -> None:
        # Messaging, as OpenTelemetry's messaging semantic conventions name them. The counters of every message
        # are local (LocalCounter); the handling time is the SDK's histogram.
        self.sent = LocalCounter(meter, "messaging.client.sent.messages", "{message}", "Messages published")
        self.consumed = LocalCounter(meter, "messaging.client.consumed.messages", "{message}",
                                     "Messages delivered to a handler")
        self.process_duration = meter.create_histogram(
            "messaging.process.duration", unit="s", description="How long a handler took over a message",
            explicit_bucket_boundaries_advisory=list(_HANDLING_BUCKETS))
        self.dead_lettered = LocalCounter(meter, "apiary.messages.dead_lettered", "{message}",
                                          "Messages sent to the dead-letter queue")
        # Jobs and rounds (the scheduler, the aggregator).
        self.jobs = meter.create_gauge("apiary.jobs", unit="{job}", description="Jobs by status")
        self.rounds_started = meter.create_counter("apiary.rounds.started", unit="{round}",
                                                   description="Rounds started (attempts)")
        self.rounds_ended = meter.create_counter("apiary.rounds.ended", unit="{round}",
                                                 description="Rounds ended, by status")
        self.round_duration = meter.create_histogram(
            "apiary.round.duration", unit="s", description="A round's time from start to end, by status",
            explicit_bucket_boundaries_advisory=list(_ROUND_BUCKETS))
        self.round_timeout_used = meter.create_gauge(
            "apiary.rounds.timeout_used", unit="1",
            description="Of the running rounds, the largest share of its aggregation timeout already spent")
        self.contributions = meter.create_counter(
            "apiary.contributions", unit="{contribution}", description="Worker reports, by outcome")
        self.aggregation_duration = meter.create_histogram(
            "apiary.aggregation.duration", unit="s", description="Closing a round: finishing its strategy, storing",
            explicit_bucket_boundaries_advisory=list(_AGGREGATION_BUCKETS))
        self.folded = meter.create_counter(
            "apiary.aggregation.folded", unit="By", description="Bytes of contributions aggregated into rounds")
        # Transfers (workers), outboxes, dependencies.
        self.transferred = meter.create_counter(
            "apiary.transfer.bytes", unit="By", description="Bytes uploaded and downloaded by presigned URL")
        self.outbox_backlog = meter.create_gauge(
            "apiary.outbox.backlog", unit="{message}", description="Events stored but not yet published")
        self.retries = meter.create_counter(
            "apiary.dependency.retries", unit="{retry}", description="Work retried while a dependency was away")
        # The fleet (the scheduler's view) and the queues.
        self.workers_online = meter.create_gauge(
            "apiary.workers.online", unit="{worker}", description="Workers online, by declared kind")
        self.queue_depth = meter.create_gauge(
            "apiary.queue.depth", unit="{message}", description="Messages ready in a queue (assign.pool, dead)")
        self.gpu_utilization = meter.create_gauge(
            "apiary.gpu.utilization", unit="1", description="A worker's GPU utilisation (0 to 1)")
        self.gpu_memory = meter.create_gauge(
            "apiary.gpu.memory.used", unit="By", description="Memory in use on a worker's GPU")
        # Experiment exporters (the tracker).
        self.exporter_backlog = meter.create_gauge(
            "apiary.exporter.backlog", unit="{record}", description="Records an experiment exporter has yet to write")
        self.exporter_failures = meter.create_counter(
            "apiary.exporter.failures", unit="{failure}", description="Failed writes of an experiment exporter")


_instruments = Instruments(NoOpMeterProvider().get_meter(METER_NAME))
_provider: Any = None
_registry: Any = None


def enabled() -> bool:
    """Whether metrics are exported from this process."""
    return _provider is not None


def prometheus_enabled() -> bool:
    """Whether this process serves a /metrics page."""
    return _registry is not None


def setup(service_name: str, value: str | None = None, *, readers: list[Any] | None = None) -> bool:
    """Install the meter provider for this process as `value` (default: `APIARY_METRICS`) says, plus any
    `readers` given (tests); whether metrics are on. Call `shutdown()` before setting up again."""
    global _provider, _registry, _instruments
    if _provider is not None:
        return True
    names = exporters(os.environ.get("APIARY_METRICS", "") if value is None else value)
    if not names and not readers:
        return False
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource

    chosen = list(readers or [])
    registry = None
    if "prometheus" in names:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, ProcessCollector

        registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, resident memory, open files
        chosen.append(PrometheusMetricReader(registry=registry))
    if "otlp" in names:
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        chosen.append(PeriodicExportingMetricReader(_otlp_exporter()))
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter

    _provider = MeterProvider(
        metric_readers=chosen, exemplar_filter=AlwaysOffExemplarFilter(),  # no exemplars: each costs a trace lookup
        resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)}))
    _registry = registry
    _instruments = Instruments(_provider.get_meter(METER_NAME))
    log.info("metrics on: %s", ", ".join(names) or "test readers")
    return True


def _otlp_exporter() -> Any:
    from apiary.telemetry import otlp_grpc

    if otlp_grpc("METRICS"):
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

        return Grpc()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

    return Http()


def shutdown() -> None:
    """Push what OTLP has not sent yet and stop; every instrument is a no-op again."""
    global _provider, _registry, _instruments
    provider, _provider, _registry = _provider, None, None
    _instruments = Instruments(NoOpMeterProvider().get_meter(METER_NAME))
    if provider is not None:
        provider.shutdown()


def exposition() -> tuple[bytes, str]:
    """The /metrics page (Prometheus text format) and its content type; LookupError while Prometheus is off."""
    registry = _registry
    if registry is None:
        raise LookupError("metrics are not exported to Prometheus here: set APIARY_METRICS=prometheus")
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST


class MetricsApp:
    """GET /metrics as an ASGI app (for processes without the tracker's HTTP API)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Answer one HTTP request (uvicorn runs it with lifespan events off)."""
        from starlette.responses import PlainTextResponse, Response

        if scope["path"] != "/metrics":
            await PlainTextResponse("not found: use /metrics\n", 404)(scope, receive, send)
            return
        try:
            body, content_type = exposition()
        except LookupError as e:
            await PlainTextResponse(f"{e}\n", 404)(scope, receive, send)
            return
        await Response(body, 200, media_type=content_type)(scope, receive, send)


# ---------------------------------------------------------------------------- what the code records


@functools.lru_cache(maxsize=1024)
def _sent_attributes(system: str, key: str, error: str | None) -> Attributes:
    attributes = {"messaging.system": system, "messaging.destination.name": destination(key),
                  "messaging.operation.name": "publish"}
    if error:
        attributes["error.type"] = error
    return tuple(sorted(attributes.items()))


@functools.lru_cache(maxsize=1024)
def _consumed_attributes(system: str, queue: str, key: str, outcome: str) -> tuple[Attributes, Mapping[str, str]]:
    attributes = {"messaging.system": system, "messaging.destination.name": destination(queue),
                  "messaging.rabbitmq.destination.routing_key": destination(key),
                  "messaging.operation.name": "process"}
    if outcome != "ack":
        attributes["error.type"] = outcome  # requeue, reroute, dead
    return tuple(sorted(attributes.items())), attributes


def message_sent(system: str, routing_key: str, error: str | None = None) -> None:
    """One message published (or, with `error`, one whose publish failed)."""
    _instruments.sent.add(1, _sent_attributes(system, routing_key, error))


def message_handled(system: str, queue: str, routing_key: str, outcome: str, started: float) -> None:
    """A delivery's handler finished (`started`: time.perf_counter() before it ran) and its outcome was decided."""
    key, attributes = _consumed_attributes(system, queue, routing_key, outcome)
    _instruments.consumed.add(1, key)
    if _provider is not None:  # the histogram's record is the one costly call: skipped while metrics are off
        _instruments.process_duration.record(time.perf_counter() - started, attributes)
    if outcome == "dead":
        _instruments.dead_lettered.add(1, (("messaging.destination.name", destination(queue)),))


def round_started() -> None:
    """The scheduler started a round (an attempt of one)."""
    _instruments.rounds_started.add(1)


def round_ended(status: str, seconds: float) -> None:
    """A round ended (aggregated, failed, cancelled) after `seconds`."""
    attributes = {"apiary.round.status": status}
    _instruments.rounds_ended.add(1, attributes)
    _instruments.round_duration.record(max(0.0, seconds), attributes)


def contribution(status: str) -> None:
    """A worker's report, recorded with this ContributionStatus: accepted, or refused as invalid (`rejected`: its
    weights failed validation), failed (the user's code), late, duplicate, forged, orphan or unassigned."""
    outcome = "invalid" if status == "rejected" else str(status)
    _instruments.contributions.add(1, {"apiary.contribution.outcome": outcome})


def aggregated(seconds: float, folded_bytes: int) -> None:
    """A round was aggregated in `seconds` from contributions of `folded_bytes` bytes."""
    _instruments.aggregation_duration.record(seconds)
    _instruments.folded.add(folded_bytes)


def transferred(direction: str, size: int) -> None:
    """Bytes moved by presigned URL (`upload` or `download`)."""
    if size > 0:
        _instruments.transferred.add(size, {"apiary.transfer.direction": direction})


def outbox_backlog(table: str, pending: int) -> None:
    """An outbox holds `pending` events not yet published."""
    _instruments.outbox_backlog.set(pending, {"apiary.outbox": table})


def dependency_retry(dependency: str) -> None:
    """Work waits for a dependency that is away, and will be tried again."""
    _instruments.retries.add(1, {"apiary.dependency": dependency or "unknown"})


def jobs(by_status: Mapping[str, int]) -> None:
    """How many jobs are in each status now."""
    for status, count in by_status.items():
        _instruments.jobs.set(count, {"apiary.job.status": status})


def workers_online(by_kind: Mapping[str, int]) -> None:
    """How many workers are online, by the kind they declared (`any`: none declared)."""
    for kind, count in by_kind.items():
        _instruments.workers_online.set(count, {"apiary.worker.kind": kind})


def round_timeout_used(share: float) -> None:
    """Of the running rounds, the largest share of its timeout already spent (0 with none running)."""
    _instruments.round_timeout_used.set(share)


def queue_depth(queue: str, ready: int) -> None:
    """Messages ready in a queue."""
    _instruments.queue_depth.set(ready, {"messaging.destination.name": queue})


def gpu(worker_id: str, reading: Mapping[str, Any] | None) -> None:
    """A worker's latest GPU reading (gpu_stats's), if it has one."""
    if not reading:
        return
    attributes: dict[str, str | int] = {"apiary.worker.id": worker_id, "apiary.gpu.index": int(reading.get("index", 0))}
    if reading.get("utilization") is not None:
        _instruments.gpu_utilization.set(float(reading["utilization"]) / 100.0, attributes)
    if reading.get("memory_used") is not None:
        _instruments.gpu_memory.set(int(reading["memory_used"]), attributes)


def exporter_backlog(exporter: str, pending: int) -> None:
    """An experiment exporter (mlflow, tensorboard) has `pending` records to write."""
    _instruments.exporter_backlog.set(pending, {"apiary.exporter": exporter})


def exporter_failed(exporter: str) -> None:
    """An experiment exporter's write failed (it is retried)."""
    _instruments.exporter_failures.add(1, {"apiary.exporter": exporter})


__all__ = [
    "Instruments", "MetricsApp", "destination", "enabled", "exporters", "exposition", "prometheus_enabled", "setup",
    "shutdown",
]
