"""A job's life across services is one trace: each handler's span is a child of the event's traceparent."""

from __future__ import annotations

import re

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.telemetry.tracing import current_traceparent, setup_tracing, start_span, start_span_from_event
from shared.events import JobAdmitted, JobCompleted, JobStarted, JobSubmitted, make_event
from tests.unit.telemetry.telemetry_builders import at, spec

TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def test_events_chain_into_one_trace() -> None:
    exporter = InMemorySpanExporter()
    setup_tracing("test", exporter=exporter)
    s = spec("traced")
    assert current_traceparent() is None
    with start_span("gpuq submit"):
        first = make_event(JobSubmitted(spec=s), source="cli", time=at(0), traceparent=current_traceparent())
    chain = [first]
    for payload in (JobAdmitted(job_id="traced", spec=s, admitted_at=at(1)),
                    JobStarted(job_id="traced", started_at=at(2)),
                    JobCompleted(job_id="traced", finished_at=at(3))):
        with start_span_from_event(chain[-1]):  # the service handling the previous event emits the next
            tp = current_traceparent()
            assert tp is not None and TRACEPARENT.match(tp)
            chain.append(make_event(payload, source="svc", time=at(0), traceparent=tp))
    with start_span_from_event(chain[-1]):
        pass
    spans = [sp for sp in exporter.get_finished_spans() if sp.attributes.get("cloudevents.event_subject") == "traced"
             or sp.name == "gpuq submit"]
    assert len(spans) == 5
    assert len({sp.context.trace_id for sp in spans}) == 1
    by_event = {sp.attributes.get("cloudevents.event_id"): sp for sp in spans}
    for event in chain:
        handled = by_event[event.id]
        assert event.traceparent is not None
        parent_span_id = int(event.traceparent.split("-")[2], 16)
        assert handled.parent is not None and handled.parent.span_id == parent_span_id


def test_event_without_traceparent_starts_a_new_trace_and_bad_exporter_is_refused() -> None:
    exporter = InMemorySpanExporter()
    setup_tracing("test", exporter=exporter)
    e = make_event(JobCompleted(job_id="x", finished_at=at(0)), source="t", time=at(0))
    with start_span_from_event(e) as span:
        assert span.get_span_context().is_valid
    (finished,) = [sp for sp in exporter.get_finished_spans() if sp.attributes.get("cloudevents.event_id") == e.id]
    assert finished.parent is None
    with pytest.raises(ValueError):
        setup_tracing("test", exporter="zipkin")


def test_without_an_exporter_spans_are_not_recorded_but_context_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    import shared.tracing

    exporter = InMemorySpanExporter()
    setup_tracing("test", exporter=exporter)
    monkeypatch.setattr(shared.tracing, "_recording", False)  # as in a process set up with exporter="none"
    exporter.clear()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    handled = make_event(JobCompleted(job_id="x", finished_at=at(0)), source="t", time=at(0), traceparent=parent)
    with start_span_from_event(handled):
        child = current_traceparent()
    assert child is not None and TRACEPARENT.match(child)
    _, trace_id, span_id, flags = child.split("-")
    assert (trace_id, flags) == ("0af7651916cd43dd8448eb211c80319c", "01") and span_id != "b7ad6b7169203331"
    unsampled = make_event(JobCompleted(job_id="x", finished_at=at(0)), source="t", time=at(0),
                           traceparent=parent[:-2] + "00")
    with start_span_from_event(unsampled):
        assert (current_traceparent() or "").endswith("-00")  # the parent's flags, as the SDK's sampler keeps them
    with start_span_from_event(make_event(JobCompleted(job_id="x", finished_at=at(0)), source="t", time=at(0))):
        fresh = current_traceparent()
    assert fresh is not None and TRACEPARENT.match(fresh) and fresh.endswith("-01")  # a new trace of its own
    assert current_traceparent() is None  # the span's context ends with it
    assert exporter.get_finished_spans() == ()
