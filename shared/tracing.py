"""W3C trace context (Trace Context Level 1, `traceparent` version 00) across services: a job's life, from
`gpuq submit` to JobCompleted, is one trace.

Every event any gpuq component publishes carries a `traceparent` (the CloudEvents distributed tracing
extension). Publishers build their events with `traced_event(...)` (the runtime's outbox writes the same bytes
with `shared.events.encode_new_event` and `outgoing_traceparent`, and `publish_event` stamps an event that has
none), whose context is, in order: the producer's own `traceparent`
when it passed a valid one (continued as it is), else the current span's, else a new trace that starts at
this event. The runtime wraps each handler in `start_span_from_event(event)` (a child of the event's
`traceparent`), so the events a handler emits continue the trace of the event it handles.

    setup_tracing("scheduler", exporter="otlp")
    with start_span_from_event(event):
        ...                       # handle; emitted events carry this span's context
    event = traced_event(NodeChanged(node=n), source="gpuq/executor-kube/0", time=now)   # any other publisher
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Span, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.events import CloudEvent, Payload, make_event

TRACEPARENT_ENV = "TRACEPARENT"
EXPORTER_ENV = "GPUQ_TRACE_EXPORTER"
_PROPAGATOR = TraceContextTextMapPropagator()
_IDS = RandomIdGenerator()
_provider: TracerProvider | None = None
# Whether an exporter was installed (setup_tracing): until one is, a handled event's span is not recorded (see
# start_span_from_event), as no one would ever read it.
_recording = False
_service_name = "gpuq"


def setup_tracing(service_name: str, exporter: str | SpanExporter = "none") -> TracerProvider:
    """Install the process's tracer provider. `exporter`: "none" (ids are still generated, so context
    propagates between services even when nothing is exported), "console", "otlp" (needs the
    opentelemetry-exporter-otlp package; endpoint from OTEL_EXPORTER_OTLP_ENDPOINT), or a SpanExporter
    instance (tests pass an InMemorySpanExporter). OpenTelemetry allows one global provider per process:
    a second call adds its exporter to the first provider."""
    global _provider, _service_name, _recording
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
    _recording = _recording or exporter != "none"
    return _provider


_tracers: dict[int, trace.Tracer] = {}


def _tracer() -> trace.Tracer:
    # One tracer per provider (get_tracer builds a new one each call, and it runs once per handled event)
    key = id(_provider)
    found = _tracers.get(key)
    if found is None:
        found = _tracers[key] = trace.get_tracer("gpuq", tracer_provider=_provider)
    return found


def context_from_traceparent(traceparent: str | None) -> otel_context.Context:
    return _PROPAGATOR.extract({"traceparent": traceparent} if traceparent else {})


# The propagator's own pattern and limit (Trace Context Level 1): `parse_traceparent` must accept exactly what
# `_PROPAGATOR.extract` accepts, so that the fast path and the SDK's never disagree on a traceparent.
_TRACEPARENT_RE = TraceContextTextMapPropagator._TRACEPARENT_HEADER_FORMAT_RE
_TRACEPARENT_MAX = TraceContextTextMapPropagator._TRACEPARENT_MAXIMUM_LENGTH
_ZERO_TRACE_ID, _ZERO_SPAN_ID = "0" * 32, "0" * 16


def parse_traceparent(traceparent: str | None) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) of a W3C traceparent a receiver can continue, else None: the propagator's checks
    (`extract`) without the Context, getter and span objects it builds, which a handler's unrecorded span and the
    validity check of every published event would otherwise pay for."""
    if not traceparent or len(traceparent) > _TRACEPARENT_MAX:
        return None
    match = _TRACEPARENT_RE.search(traceparent)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if trace_id == _ZERO_TRACE_ID or span_id == _ZERO_SPAN_ID or version == "ff" or (version == "00" and rest):
        return None
    return int(trace_id, 16), int(span_id, 16), int(flags, 16)


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The traceparent the propagator's `inject` writes for these ids (version 00, lower-case hex)."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


@contextlib.contextmanager
def start_span_from_event(event: CloudEvent, name: str | None = None,
                          attributes: dict[str, Any] | None = None) -> Iterator[Span]:
    """A CONSUMER span for handling `event`, child of its traceparent (a new trace when it has none). Without an
    exporter (`setup_tracing(..., exporter="none")`) the span is a non-recording one with ids of its own, as the
    SDK makes for a span it does not sample: its context propagates exactly as a recorded span's would (same trace,
    a new span id, the parent's flags and trace state), without the cost of recording what nothing exports."""
    if not _recording:
        # Made current by hand: `trace.use_span` would add only the recording of an exception on the span, which a
        # non-recording span ignores.
        span = _unrecorded_child(event.traceparent)
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            yield span
        finally:
            otel_context.detach(token)
        return
    attrs: dict[str, Any] = {"cloudevents.event_id": event.id, "cloudevents.event_type": event.type,
                             "cloudevents.event_source": event.source, "service.name": _service_name}
    if event.subject:
        attrs["cloudevents.event_subject"] = event.subject
    attrs.update(attributes or {})
    parent = context_from_traceparent(event.traceparent)
    with _tracer().start_as_current_span(name or f"handle {event.type}", context=parent, kind=SpanKind.CONSUMER,
                                         attributes=attrs) as span:
        yield span


def _unrecorded_child(traceparent: str | None) -> Span:
    """A non-recording span child of `traceparent`: its trace, flags and state, a new span id; a new sampled trace
    (as the SDK's default sampler starts one) when `traceparent` is missing or invalid."""
    # The parent as the propagator extracts it: its trace state is always empty, as gpuq carries no `tracestate`.
    parent = parse_traceparent(traceparent)
    if parent is not None:
        child = SpanContext(trace_id=parent[0], span_id=_IDS.generate_span_id(), is_remote=False,
                            trace_flags=TraceFlags(parent[2]))
    else:
        child = SpanContext(trace_id=_IDS.generate_trace_id(), span_id=_IDS.generate_span_id(), is_remote=False,
                            trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.NonRecordingSpan(child)


@contextlib.contextmanager
def command_span(name: str) -> Iterator[Span]:
    """A PRODUCER span for a command that publishes events (`gpuq submit`), so a job's trace starts where the
    user submitted it. It continues the caller's context from the `TRACEPARENT` environment variable (the
    OpenTelemetry convention for passing context to a child process, e.g. from a CI job or pipeline step)."""
    if _provider is None:
        from shared.settings import settings  # here: the CLI's start-up does not pay for pydantic-settings

        setup_tracing("gpuq-cli", exporter=settings().trace_exporter)
    with start_span(name, traceparent=os.environ.get(TRACEPARENT_ENV)) as span:
        yield span


@contextlib.contextmanager
def start_span(name: str, traceparent: str | None = None) -> Iterator[Span]:
    """A PRODUCER span for work that starts a trace (e.g. `gpuq submit` before JobSubmitted)."""
    with _tracer().start_as_current_span(name, context=context_from_traceparent(traceparent),
                                         kind=SpanKind.PRODUCER) as span:
        yield span


def current_traceparent() -> str | None:
    """The W3C `traceparent` of the current span, for events emitted now (None outside any span)."""
    # What `_PROPAGATOR.inject` writes, without its carrier and setter.
    context = trace.get_current_span().get_span_context()
    if context == trace.INVALID_SPAN_CONTEXT:
        return None
    return format_traceparent(context.trace_id, context.span_id, context.trace_flags)


def valid_traceparent(traceparent: str | None) -> bool:
    """Whether `traceparent` is a W3C traceparent a receiver can continue (right shape, non-zero ids)."""
    return parse_traceparent(traceparent) is not None


_last_valid: list[str | None] = [None]


def outgoing_traceparent(traceparent: str | None = None) -> str:
    """The `traceparent` of an event published now: the producer's own `traceparent` when it is valid (continued
    unchanged), else the current span's, else a new trace's root (random ids, sampled), so that no event leaves
    without trace context."""
    if traceparent and (traceparent == _last_valid[0] or valid_traceparent(traceparent)):
        # (the last one found valid is remembered: a unit of work's events continue the same trace)
        _last_valid[0] = traceparent
        return traceparent
    current = current_traceparent()
    if current is not None:
        return current
    return format_traceparent(_IDS.generate_trace_id(), _IDS.generate_span_id(), TraceFlags.SAMPLED)


def traced_event(payload: Payload, *, source: str, time: datetime, traceparent: str | None = None,
                 subject: str | None = None, event_id: str | None = None) -> CloudEvent:
    """The CloudEvent every gpuq publisher sends: `make_event` with `outgoing_traceparent(traceparent)`."""
    return make_event(payload, source=source, time=time, subject=subject, event_id=event_id,
                      traceparent=outgoing_traceparent(traceparent))


def with_trace_context(event: CloudEvent) -> CloudEvent:
    """`event` itself when it carries a valid `traceparent`, else a copy with `outgoing_traceparent()`."""
    if valid_traceparent(event.traceparent):
        return event
    return event.model_copy(update={"traceparent": outgoing_traceparent()})
