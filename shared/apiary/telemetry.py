"""Tracing: one trace per round across every process, configured like any OpenTelemetry program.

Exporters follow OpenTelemetry's standard variables: OTEL_TRACES_EXPORTER (none, console, otlp),
OTEL_EXPORTER_OTLP_PROTOCOL (grpc, http/protobuf), OTEL_EXPORTER_OTLP_ENDPOINT and the rest, and
OTEL_SERVICE_NAME (else each process names itself: apiary-scheduler, apiary-worker, ...).

A round outlives any one handler (and may outlive a process), so its span is not held open: the
scheduler chooses the round span's ids when the round starts, stores them with the round, sends
them as the parent in every message of the round (W3C trace context in the headers), and records
the round span itself, with its original start time and those same ids, when the round ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import random
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, TraceFlags

log = logging.getLogger("apiary.telemetry")

TRACER_NAME = "apiary"
MESSAGING_SYSTEM = "rabbitmq"
_fixed_ids: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("apiary_fixed_ids", default=None)


class _RoundIds(IdGenerator):
    """Random ids, except inside `recorded_span`, where the round's stored ids are used."""

    def generate_span_id(self) -> int:
        fixed = _fixed_ids.get()
        return fixed[1] if fixed else random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        fixed = _fixed_ids.get()
        return fixed[0] if fixed else random.getrandbits(128) or 1


_provider: TracerProvider | None = None


def setup(service_name: str, *, exporter: SpanExporter | None = None) -> TracerProvider | None:
    """Install the tracer provider for this process; returns None when tracing is off."""
    global _provider
    if _provider is not None:
        return _provider
    chosen = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if exporter is None and chosen in ("", "none"):
        return None
    provider = TracerProvider(
        resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)}),
        id_generator=_RoundIds(),
    )
    processor: SpanProcessor
    if exporter is not None:
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        processor = SimpleSpanProcessor(exporter)
    elif chosen == "console":
        processor = BatchSpanProcessor(ConsoleSpanExporter())
    elif chosen == "otlp":
        processor = BatchSpanProcessor(_otlp_exporter())
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER={chosen!r} is not supported: use none, console or otlp")
    provider.add_span_processor(processor)
    # Kept here rather than installed globally, so a process (or a test) can set tracing up again
    # after shutdown(); OpenTelemetry's global provider can be set only once.
    _provider = provider
    return provider


def otlp_grpc(signal: str) -> bool:
    """Whether OTLP for `signal` (TRACES, METRICS) goes over gRPC (else HTTP/protobuf), as OpenTelemetry's
    variables say; ValueError for another protocol."""
    protocol = (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")).strip().lower()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: use grpc or http/protobuf")
    return protocol == "grpc"


def _otlp_exporter() -> SpanExporter:
    if otlp_grpc("TRACES"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http()


def shutdown() -> None:
    """Flush and stop the exporter (call before the process exits)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracer() -> trace.Tracer:
    """Apiary's tracer (a no-op one when tracing is off)."""
    if _provider is not None:
        return _provider.get_tracer(TRACER_NAME)
    return trace.NoOpTracer()


def new_round_ids() -> tuple[int, int]:
    """A fresh (trace id, span id) for a round span."""
    return random.getrandbits(128) or 1, random.getrandbits(64) or 1


def round_context(trace_id: int, span_id: int) -> otel_context.Context:
    """A context whose parent is the round span (recorded later) with these ids."""
    parent = SpanContext(trace_id=trace_id, span_id=span_id, is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def headers_for(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """W3C trace context headers for a message (from `ctx`, else the current context)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def context_from(headers: Mapping[str, Any] | None) -> otel_context.Context:
    """The trace context a message carries."""
    return propagate.extract({k: str(v) for k, v in (headers or {}).items()})


def link_from(headers: Mapping[str, Any] | None) -> Link | None:
    """A link to the span a message was sent from, if it carries one."""
    span_context = trace.get_current_span(context_from(headers)).get_span_context()
    return Link(span_context) if span_context.is_valid else None


@contextlib.contextmanager
def attached(headers: Mapping[str, Any] | None) -> Iterator[None]:
    """Make a message's trace context current while its handler runs."""
    token = otel_context.attach(context_from(headers))
    try:
        yield
    finally:
        otel_context.detach(token)


def recorded_span(name: str, trace_id: int, span_id: int, start_ns: int, attributes: dict[str, Any],
                  *, error: str | None = None) -> None:
    """Record a span that began earlier (the round), with its stored ids and start time."""
    token = _fixed_ids.set((trace_id, span_id))
    try:
        span = tracer().start_span(name, context=otel_context.Context(), kind=SpanKind.INTERNAL,
                                   start_time=start_ns, attributes=attributes)
    finally:
        _fixed_ids.reset(token)
    if error:
        span.add_event("round.failed", {"reason": error})
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end()


def messaging(routing_key: str, operation: str, exchange: str = "apiary") -> dict[str, str]:
    """OpenTelemetry messaging attributes for a RabbitMQ publish or process."""
    return {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.destination.name": exchange,
        "messaging.rabbitmq.destination.routing_key": routing_key,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
    }


@contextlib.contextmanager
def consumer_span(routing_key: str, exchange: str, attributes: Mapping[str, Any]) -> Iterator[Span]:
    """The current span while a consumed message is processed: `<routing key> process`, with the
    messaging attributes and these."""
    with tracer().start_as_current_span(
        f"{routing_key} process", kind=SpanKind.CONSUMER,
        attributes={**messaging(routing_key, "process", exchange), **attributes},
    ) as span:
        yield span


def fail(span: Span, event: str, reason: str) -> None:
    """Mark a span as failed, with an event that says why."""
    span.add_event(event, {"reason": reason})
    span.set_status(trace.Status(trace.StatusCode.ERROR, reason))
