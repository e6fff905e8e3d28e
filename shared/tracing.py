"""W3C trace context across services: a job's life, JobSubmitted to JobCompleted, is one trace.

The runtime wraps each handler in `start_span_from_event(event)` (a child of the event's `traceparent`)
and stamps the events it emits with `current_traceparent()`, so every hop continues the same trace.

    setup_tracing("scheduler", exporter="otlp")
    with start_span_from_event(event):
        ...                       # handle; emitted events carry current_traceparent()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.events import CloudEvent

_PROPAGATOR = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_service_name = "gpuq"


def setup_tracing(service_name: str, exporter: str | SpanExporter = "none") -> TracerProvider:
    """Install the process's tracer provider. `exporter`: "none" (ids are still generated, so context
    propagates between services even when nothing is exported), "console", "otlp" (needs the
    opentelemetry-exporter-otlp package; endpoint from OTEL_EXPORTER_OTLP_ENDPOINT), or a SpanExporter
    instance (tests pass an InMemorySpanExporter). OpenTelemetry allows one global provider per process:
    a second call adds its exporter to the first provider."""
    global _provider, _service_name
    _service_name = service_name
    if _provider is None:
        _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        trace.set_tracer_provider(_provider)
    if isinstance(exporter, SpanExporter):
        _provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        _provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError("exporter='otlp' needs the opentelemetry-exporter-otlp-proto-http package") from exc
        _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter != "none":
        raise ValueError(f"unknown trace exporter {exporter!r}: use none, console or otlp")
    return _provider


def _tracer() -> trace.Tracer:
    return trace.get_tracer("gpuq", tracer_provider=_provider)


def context_from_traceparent(traceparent: str | None) -> otel_context.Context:
    return _PROPAGATOR.extract({"traceparent": traceparent} if traceparent else {})


@contextlib.contextmanager
def start_span_from_event(event: CloudEvent, name: str | None = None,
                          attributes: dict[str, Any] | None = None) -> Iterator[Span]:
    """A CONSUMER span for handling `event`, child of its traceparent (a new trace when it has none)."""
    attrs: dict[str, Any] = {"cloudevents.event_id": event.id, "cloudevents.event_type": event.type,
                             "cloudevents.event_source": event.source, "service.name": _service_name}
    if event.subject:
        attrs["cloudevents.event_subject"] = event.subject
    attrs.update(attributes or {})
    parent = context_from_traceparent(event.traceparent)
    with _tracer().start_as_current_span(name or f"handle {event.type}", context=parent, kind=SpanKind.CONSUMER,
                                         attributes=attrs) as span:
        yield span


@contextlib.contextmanager
def start_span(name: str, traceparent: str | None = None) -> Iterator[Span]:
    """A PRODUCER span for work that starts a trace (e.g. `gpuq submit` before JobSubmitted)."""
    with _tracer().start_as_current_span(name, context=context_from_traceparent(traceparent),
                                         kind=SpanKind.PRODUCER) as span:
        yield span


def current_traceparent() -> str | None:
    """The W3C `traceparent` of the current span, for events emitted now (None outside any span)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")
