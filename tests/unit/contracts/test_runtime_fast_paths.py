"""The shared runtime's fast paths give what the slow ones gave: event ids, W3C traceparent parsing and formatting,
the unrecorded span, building an envelope, decoding a body, routing a subject to its stream; and malformed input
is still refused with the same reason (and dead-lettered by the runtime)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from pydantic import ValidationError

from gpuq_tools.bench import runtime as runtime_bench
from shared import bus, events, tracing
from shared.domain import GpuBinding, JobSpec, NodeSpec, PodSet
from shared.events import (
    SPEC_VERSION,
    AuditRecorded,
    CloudEvent,
    EmittedEvent,
    InvalidEvent,
    JobCompleted,
    JobPlaced,
    JobRejected,
    JobSubmitted,
    NodeChanged,
    Payload,
    encode_event,
    encode_new_event,
    make_event,
    new_event_id,
    parse_event,
    schema_uri,
)
from shared.service import ServiceRuntime, ServiceSpec, _DeadLetter

T = datetime(2026, 12, 1, 12, 0, 0, 123456, tzinfo=UTC)
TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _spec(job: str = "job-1") -> JobSpec:
    return JobSpec(job_id=job, team="team-a", queue="team-a", pod_sets=(PodSet(count=2, gpus_per_pod=4),))


PAYLOADS: list[Payload] = [
    JobSubmitted(spec=_spec(), submitted_at=T, submitted_by="team:team-a"),
    JobPlaced(job_id="job-1", spec=_spec(), placed_at=T, fencing_token=2,
              bindings=(GpuBinding(pod="main-0", node="n1", gpu_indices=(0, 1, 2, 3)),)),
    JobCompleted(job_id="job-1", finished_at=T),
    JobRejected(job_id="job-2", reason="Invalid", message="no"),
    NodeChanged(node=NodeSpec(name="n1", gpus=8, gpu_model="H100", cpu_milli=1, memory_mib=1,
                                rack="r1", block="b1")),  # no job: subject None
]


# --------------------------------------------------------------------------- event ids


def test_event_ids_are_unique_version_4_uuids() -> None:
    ids = [new_event_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    for i in ids[:500]:
        parsed = uuid.UUID(i)
        assert str(parsed) == i  # canonical lower-case form, as str(uuid.uuid4()) gives
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122


# --------------------------------------------------------------------------- traceparent

TRACEPARENTS = [
    TP,
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",  # not sampled
    "  00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # leading blanks are allowed
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 \t",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\n",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # version 00 takes nothing more
    "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # a later version may
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff is invalid
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # upper case
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
    "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-" + "x" * 600,  # longer than the 512 limit
    "garbage", "", None,
]


def _extracted(traceparent: str | None) -> tuple[int, int, int] | None:
    """What the SDK's propagator makes of it (the slow path)."""
    ctx = trace.get_current_span(tracing.context_from_traceparent(traceparent)).get_span_context()
    return (ctx.trace_id, ctx.span_id, int(ctx.trace_flags)) if ctx.is_valid else None


@pytest.mark.parametrize("traceparent", TRACEPARENTS)
def test_parse_traceparent_accepts_exactly_what_the_propagator_does(traceparent: str | None) -> None:
    assert tracing.parse_traceparent(traceparent) == _extracted(traceparent)
    assert tracing.valid_traceparent(traceparent) is (_extracted(traceparent) is not None)


def test_traceparent_round_trips_and_matches_what_the_propagator_injects() -> None:
    for trace_id, span_id, flags in [(1, 1, 0), (2**128 - 1, 2**64 - 1, 1), (0x4BF92F35, 0xF067AA, 1)]:
        formatted = tracing.format_traceparent(trace_id, span_id, flags)
        assert tracing.parse_traceparent(formatted) == (trace_id, span_id, flags)
        carrier: dict[str, str] = {}
        span = NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(flags)))
        tracing._PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        assert carrier["traceparent"] == formatted
        with trace.use_span(span):
            assert tracing.current_traceparent() == formatted
    assert tracing.current_traceparent() is None  # outside any span


def _event(traceparent: str | None) -> CloudEvent:
    return make_event(JobCompleted(job_id="job-1", finished_at=T), source="gpuq/test/0", time=T,
                      traceparent=traceparent)


@pytest.mark.parametrize("traceparent", [TP, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"])
def test_an_unrecorded_span_continues_the_trace_made_current(traceparent: str) -> None:
    trace_id, span_id, flags = tracing.parse_traceparent(traceparent) or (0, 0, 0)
    with tracing.start_span_from_event(_event(traceparent)) as span:
        ctx = span.get_span_context()
        assert not span.is_recording()
        assert (ctx.trace_id, int(ctx.trace_flags)) == (trace_id, flags) and ctx.span_id != span_id
        assert trace.get_current_span() is span
        assert tracing.current_traceparent() == tracing.format_traceparent(trace_id, ctx.span_id, flags)
        # What the handler emits continues this span.
        assert tracing.outgoing_traceparent() == tracing.current_traceparent()
    assert tracing.current_traceparent() is None  # detached on exit


def test_an_unrecorded_span_is_detached_when_the_handler_raises() -> None:
    with pytest.raises(RuntimeError), tracing.start_span_from_event(_event(TP)):
        raise RuntimeError("handler failed")
    assert tracing.current_traceparent() is None


@pytest.mark.parametrize("traceparent", [None, "garbage", "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"])
def test_an_event_without_a_valid_parent_starts_a_new_sampled_trace(traceparent: str | None) -> None:
    with tracing.start_span_from_event(_event(traceparent)) as span:
        ctx = span.get_span_context()
        assert ctx.is_valid and ctx.trace_flags.sampled
    roots = {tracing.outgoing_traceparent() for _ in range(100)}
    assert len(roots) == 100 and all(tracing.valid_traceparent(r) for r in roots)
    assert all((tracing.parse_traceparent(r) or (0, 0, 0))[2] == 1 for r in roots)


# --------------------------------------------------------------------------- building an envelope


def _validated(payload: Payload, source: str, event_id: str, traceparent: str | None) -> CloudEvent:
    """The envelope as validation builds it (the slow path)."""
    event_type = payload.event_type()
    return CloudEvent(specversion=SPEC_VERSION, id=event_id, source=source, type=event_type, time=T,
                      subject=payload.job_key(), dataschema=schema_uri(event_type), traceparent=traceparent,
                      data=payload.model_dump(mode="json"))


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("traceparent", [TP, None])
def test_make_event_builds_what_validation_builds(payload: Payload, traceparent: str | None) -> None:
    for source in ("gpuq/scheduler/0", "gpuq/scheduler/1"):  # a second source is a template of its own
        event_id = new_event_id()
        fast = make_event(payload, source=source, time=T, event_id=event_id, traceparent=traceparent)
        slow = _validated(payload, source, event_id, traceparent)
        assert fast == slow
        assert fast.model_fields_set == slow.model_fields_set
        assert encode_event(fast) == encode_event(slow)
        assert parse_event(encode_event(fast)) == parse_event(encode_event(slow))


def test_make_event_still_refuses_what_validation_refuses() -> None:
    payload = JobCompleted(job_id="job-1", finished_at=T)
    make_event(payload, source="gpuq/ok/0", time=T)  # a template exists for this type now
    with pytest.raises(ValidationError, match="URI-reference"):
        make_event(payload, source="gpuq bad source", time=T)
    with pytest.raises(ValidationError, match="subject"):
        make_event(payload, source="gpuq/ok/0", time=T, subject="")
    with pytest.raises(ValueError, match="no zone"):
        make_event(payload, source="gpuq/ok/0", time=datetime(2026, 1, 1))


def test_events_built_from_one_template_share_no_state() -> None:
    a = make_event(PAYLOADS[1], source="gpuq/t/0", time=T)
    b = make_event(PAYLOADS[2], source="gpuq/t/0", time=T)
    assert a.id != b.id and a.data != b.data and a.type != b.type


# A payload whose JSON needs escaping, with a null, nested values and a time (a payload's own serialisation is what
# its body carries; it must be byte for byte what the envelope's `data` dict serialises to).
AWKWARD = AuditRecorded(action="submit", actor="team:t\u00e9", at=T, job_id='job-"7"\n\u2603', team=None,
                        detail={"b": 1.5, "a": [1, {"x": None}], "big": 1e300, "tiny": 5e-324, "neg": -0.0})


@pytest.mark.parametrize("payload", [*PAYLOADS, AWKWARD], ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("at", [T, datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 1, 3, 4, 5, 6, tzinfo=UTC)])
def test_a_new_event_is_encoded_as_the_envelope_would_encode_it(payload: Payload, at: datetime) -> None:
    for source in ("gpuq/scheduler/0", "gpuq/admission"):
        event_id, body = encode_new_event(payload, source=source, time=at, traceparent=TP)
        assert body == encode_event(make_event(payload, source=source, time=at, event_id=event_id, traceparent=TP))
        event, parsed = parse_event(body)
        assert (event.id, event.source, event.time, event.traceparent, parsed) == (event_id, source, at, TP, payload)
        emitted = EmittedEvent(event_id, body, payload)
        assert (emitted.type, emitted.event()) == (payload.event_type(), event)
    assert encode_new_event(payload, source="gpuq/t/0", time=at, traceparent=TP)[0] != event_id


def test_a_new_event_is_refused_as_make_event_refuses_it() -> None:
    payload = JobCompleted(job_id="job-1", finished_at=T)
    with pytest.raises(ValidationError, match="URI-reference"):
        encode_new_event(payload, source="gpuq bad source", time=T, traceparent=TP)
    with pytest.raises(ValidationError, match="subject"):
        encode_new_event(payload, source="gpuq/ok/0", time=T, subject="", traceparent=TP)
    with pytest.raises(ValueError, match="no zone"):
        encode_new_event(payload, source="gpuq/ok/0", time=datetime(2026, 1, 1), traceparent=TP)


# --------------------------------------------------------------------------- decoding a body

BODIES: list[bytes] = [
    encode_event(make_event(p, source="gpuq/test/0", time=T, traceparent=TP)) for p in PAYLOADS
] + [
    # Bodies pydantic-core's parser refuses and json.loads takes: decided by json.loads, as before.
    "\ufeff".encode() + encode_event(make_event(PAYLOADS[2], source="gpuq/test/0", time=T)),
    json.dumps(json.loads(encode_event(make_event(PAYLOADS[2], source="gpuq/test/0", time=T)))).encode("utf-16"),
]
# a lone surrogate escape (json.dumps writes one as \ud800): decoded by json.loads, then refused (no UTF-8 for it)
LONE_SURROGATE = json.dumps({**json.loads(encode_event(make_event(PAYLOADS[3], source="gpuq/t/0", time=T))),
                             "data": {"job_id": "job-3", "reason": "X", "message": "\ud800"}}).encode()


def _slow_parse(raw: bytes) -> Any:
    """parse_event with json.loads as its decoder, as it was."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(events, "_decode_json", json.loads)
        return parse_event(raw)


@pytest.mark.parametrize("raw", BODIES)
def test_decoding_gives_what_json_loads_gives(raw: bytes) -> None:
    assert events._decode_json(raw) == json.loads(raw)
    assert parse_event(raw) == _slow_parse(raw)


MALFORMED = [b"{oops", b'{"a":1} x', b'{"a":1,}', b"{'a':1}", b'{"a":"\xff"}', b"", b"[1, 2]", b'"text"', b"null",
             b'{"specversion": "0.3"}', b'{"specversion": "1.0"}', LONE_SURROGATE]


@pytest.mark.parametrize("raw", MALFORMED)
def test_malformed_bodies_are_refused_with_the_same_reason_and_message(raw: bytes) -> None:
    with pytest.raises(InvalidEvent) as fast:
        parse_event(raw)
    with pytest.raises(InvalidEvent) as slow:
        _slow_parse(raw)
    assert (fast.value.reason, fast.value.message) == (slow.value.reason, slow.value.message)


def test_a_cached_attribute_value_passes_only_for_the_attribute_it_was_checked_for() -> None:
    good = json.loads(encode_event(make_event(PAYLOADS[2], source="gpuq/relative/0", time=T)))
    parse_event(json.dumps(good).encode())  # "gpuq/relative/0" is a good source (a URI-reference) ...
    with pytest.raises(InvalidEvent, match="absolute URI"):  # ... and no dataschema (not an absolute URI)
        parse_event(json.dumps({**good, "dataschema": "gpuq/relative/0"}).encode())
    with pytest.raises(InvalidEvent, match="URI-reference"):
        parse_event(json.dumps({**good, "source": "gpuq relative"}).encode())


@pytest.mark.parametrize("attribute", ["source", "datacontenttype", "dataschema"])
@pytest.mark.parametrize("value", [{"a": 1}, ["gpuq/test/0"], 7, True])
def test_an_attribute_of_the_wrong_type_is_refused_as_malformed(attribute: str, value: Any) -> None:
    doc = json.loads(encode_event(make_event(PAYLOADS[2], source="gpuq/test/0", time=T)))
    with pytest.raises(InvalidEvent) as refused:  # never a TypeError from the cache of checked values
        parse_event(json.dumps({**doc, attribute: value}).encode())
    assert refused.value.reason == "MalformedEnvelope" and attribute in refused.value.message


def test_a_null_attribute_is_still_absent() -> None:
    doc = json.loads(encode_event(make_event(PAYLOADS[2], source="gpuq/test/0", time=T)))
    event, _ = parse_event(json.dumps({**doc, "traceparent": None, "dataschema": None}).encode())
    assert event.traceparent is None and event.dataschema is None
    assert "traceparent" not in event.model_fields_set


def test_malformed_input_is_dead_lettered_by_the_runtime_with_its_reason() -> None:
    async def handler(*_: Any) -> None:
        raise AssertionError("never reached")

    runtime = ServiceRuntime(ServiceSpec(name="t", schema="t", handlers={JobCompleted: handler}),
                             nats_url="nats://127.0.0.1:4222", pool=None)
    for raw, reason in [(b"{oops", "MalformedJson"), (b"[1]", "MalformedEnvelope"),
                        (json.dumps({**json.loads(BODIES[2]), "data": {"job_id": "j"}}).encode(), "InvalidPayload")]:
        with pytest.raises(_DeadLetter) as verdict:
            runtime._prepare(raw, JobCompleted.subject())
        assert verdict.value.reason == reason and verdict.value.message
    assert runtime._prepare(BODIES[2], JobCompleted.subject()) is not None


# --------------------------------------------------------------------------- routing


def test_stream_for_subject_is_cached_per_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    for ns in ("gpuq", "other-ns"):
        monkeypatch.setenv("GPUQ_NAMESPACE", ns)
        for subject, suffix in [(f"{ns}.job.placed", "JOBS"), (f"{ns}.job.submitted.team-a", "JOBS"),
                                (f"{ns}.node.changed", "CLUSTER"), (f"{ns}.dlq.admission", "DLQ")]:
            for _ in range(2):
                assert bus.stream_for_subject(subject) == bus._stream_of(ns, subject)
                assert bus.stream_for_subject(subject).name == f"{ns.upper().replace('-', '_')}_{suffix}"
        for _ in range(2):  # a miss is never remembered as a hit
            with pytest.raises(LookupError, match="no stream"):
                bus.stream_for_subject(f"{ns}.nothing.here")
    monkeypatch.setenv("GPUQ_NAMESPACE", "gpuq")
    with pytest.raises(LookupError):  # another namespace's subject is not this one's
        bus.stream_for_subject("other-ns.job.placed")


def test_the_runtime_micro_benchmark_runs() -> None:
    figures = runtime_bench.measure(20)
    assert figures and all(v > 0 for v in figures.values())
