"""The limits on a received body (docs/events.md, "Limits"): whatever bytes arrive, `parse_event` answers with an
event or an InvalidEvent naming what is wrong, never anything else (issue 43: a 2 KB body nested 1,000 deep raised
RecursionError and stopped admission's consumer for good). And what Postgres cannot store (a NUL, a lone
surrogate, an oversized string) is refused by the models themselves, naming the field."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shared.domain import MAX_STRING_CHARS, JobSpec, PodSet, PodTemplate, unstorable
from shared.events import (
    MAX_DEPTH,
    MAX_EVENT_BYTES,
    InvalidEvent,
    JobAttemptFailed,
    JobFailed,
    JobSubmitted,
    encode_event,
    make_event,
    parse_event,
    too_deep,
)

T = datetime(2026, 1, 1, tzinfo=UTC)


def spec(**extra: Any) -> JobSpec:
    return JobSpec(**{"job_id": "j-1", "team": "team-a", "queue": "team-a", "pod_sets": (PodSet(),), **extra})


def submitted_doc(**extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(encode_event(make_event(JobSubmitted(spec=spec(**extra)), source="t", time=T)))
    return doc


def body(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def refused(raw: bytes | str | dict[str, Any]) -> InvalidEvent:
    with pytest.raises(InvalidEvent) as caught:
        parse_event(raw)
    return caught.value


# ------------------------------------------------------------------------------ depth and size


@pytest.mark.parametrize("nest", [
    lambda n: '{"a":' * n + "1" + "}" * n,  # the poison pill of issue 43: 2 KB, 1,000 deep
    lambda n: "[" * n + "]" * n,
    lambda n: '{"a":[' * (n // 2) + "]}" * (n // 2),
], ids=["objects", "arrays", "mixed"])
def test_a_deeply_nested_body_is_too_deep_not_a_recursion_error(nest: Any) -> None:
    raw = nest(1000).encode()
    assert len(raw) < 8 * 1024
    error = refused(raw)
    assert error.reason == "TooDeep" and str(MAX_DEPTH) in error.message


def test_deep_nesting_inside_a_valid_envelope_is_too_deep() -> None:
    doc = submitted_doc()
    raw = body(doc).replace(b'"labels":{}', b'"labels":' + b'{"a":' * 1000 + b"1" + b"}" * 1000)
    assert refused(raw).reason == "TooDeep"
    deep: Any = 1
    for _ in range(1000):
        deep = {"a": deep}
    doc["data"]["spec"]["labels"] = deep
    assert refused(doc).reason == "TooDeep"  # an in-process dict too: no recursion either


def test_nesting_up_to_the_limit_is_read_and_brackets_inside_strings_do_not_count() -> None:
    def with_volume(levels: int) -> bytes:
        # envelope, data, spec, pod_sets, pod set, template, volumes, then the volume's own nesting
        volume: Any = "x"
        for _ in range(levels - 7):
            volume = {"v": volume}
        template = PodTemplate(image="img", volumes=(volume,))
        return encode_event(make_event(JobSubmitted(spec=spec(pod_sets=(PodSet(template=template),))),
                                       source="t", time=T))

    assert not too_deep(with_volume(MAX_DEPTH)) and too_deep(with_volume(MAX_DEPTH + 1))
    parse_event(with_volume(MAX_DEPTH))
    assert refused(with_volume(MAX_DEPTH + 1)).reason == "TooDeep"
    brackets = "[{" * 3000 + '\\"' + "]}" * 10  # in a string: data, not structure
    _, payload = parse_event(encode_event(make_event(JobSubmitted(spec=spec(labels={"x": brackets})), source="t",
                                                     time=T)))
    assert isinstance(payload, JobSubmitted) and payload.spec.labels["x"] == brackets


@pytest.mark.parametrize("raw", [
    b'"\\"' * 200_000,  # one string never closed, made of escaped quotes
    b'["' + b'\\' * 300_000,
    b'{"a":"' + b"[" * 400_000,
    b"[" * 400_000,
])
def test_the_depth_scan_is_linear_on_hostile_strings(raw: bytes) -> None:
    """A backtracking scan would take hours on these; this one answers at once (the suite would hang)."""
    assert refused(raw).reason in ("MalformedJson", "TooDeep")


def test_a_body_over_the_byte_limit_is_too_large() -> None:
    doc = submitted_doc()
    raw = body(doc)
    padded = raw[:-1] + b"," + b'"pad":"' + b"x" * (MAX_EVENT_BYTES - len(raw)) + b'"}'
    assert len(padded) > MAX_EVENT_BYTES
    error = refused(padded)
    assert error.reason == "TooLarge" and str(MAX_EVENT_BYTES) in error.message


# ------------------------------------------------------------------------------ what Postgres cannot store


@pytest.mark.parametrize(("where", "named"), [
    (lambda d: d["data"]["spec"]["labels"].update({"team": "a\u0000b"}), "data.spec.labels.team"),
    (lambda d: d["data"]["spec"]["labels"].update({"te\u0000am": "ab"}), "data.spec.labels: key 'te\\x00am'"),
    (lambda d: d["data"]["spec"]["pod_sets"][0].update({"name": "\u0000"}), "data.spec.pod_sets[0].name"),
    (lambda d: d["data"].update({"submitted_by": "x\u0000"}), "data.submitted_by"),
    (lambda d: d["data"].update({"unknown": {"deep": ["x\u0000"]}}), "data.unknown.deep[0]"),
], ids=["label-value", "label-key", "pod-set-name", "claimed-submitter", "ignored-field"])
def test_a_nul_anywhere_in_the_data_is_an_invalid_payload_naming_where(where: Any, named: str) -> None:
    doc = submitted_doc()
    where(doc)
    error = refused(body(doc))
    assert error.reason == "InvalidPayload" and error.message.startswith(named), error.message
    assert "NUL" in error.message and "\x00" not in error.message  # the reason is stored in Postgres too


@pytest.mark.parametrize("attribute", ["id", "source", "subject", "traceparent"])
def test_a_nul_in_an_envelope_attribute_is_a_malformed_envelope(attribute: str) -> None:
    doc = submitted_doc()
    doc[attribute] = "x\u0000y"
    error = refused(body(doc))
    assert error.reason == "MalformedEnvelope" and error.message.startswith(attribute)


def test_lone_surrogates_are_refused_and_pairs_are_text() -> None:
    doc = submitted_doc(labels={"emoji": "\U0001f600"})
    escaped = body(doc)  # json.dumps writes the emoji as the pair \ud83d\ude00
    assert b"\\ud83d\\ude00" in escaped
    assert parse_event(escaped)[1].spec.labels["emoji"] == "\U0001f600"  # type: ignore[attr-defined]
    lone = escaped.replace(b"\\ud83d\\ude00", b"\\ud83d")
    error = refused(lone)
    assert error.reason == "InvalidPayload" and "data.spec.labels.emoji" in error.message
    assert "surrogate" in error.message
    raw_bytes = body(submitted_doc()).replace(b'"labels":{}', b'"labels":{"x":"\xed\xa0\x80"}')
    assert refused(raw_bytes).reason in ("InvalidPayload", "MalformedJson")


def test_an_oversized_string_or_identifier_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"labels\.big: 1048577 characters, above the limit of 1048576"):
        JobSpec.model_validate({"job_id": "j", "team": "team-a", "queue": "team-a", "pod_sets": [{}],
                                "labels": {"big": "x" * (MAX_STRING_CHARS + 1)}})
    doc = submitted_doc()
    doc["data"]["spec"]["labels"]["big"] = "x" * (MAX_STRING_CHARS + 1)
    assert refused(body(doc)).reason == "TooLarge"  # no event holds it
    doc["data"]["spec"]["labels"]["big"] = "x" * 900_000  # one that fits: governance's to judge (SpecTooLarge)
    parse_event(body(doc))
    doc = submitted_doc()
    doc["id"] = "e" * 5000  # the inbox's primary key: an index entry holds about 2.7 KB
    error = refused(body(doc))
    assert error.reason == "MalformedEnvelope" and error.message.startswith("id: 5000 characters")


def test_the_models_refuse_what_postgres_cannot_store_naming_the_field() -> None:
    """The API validates a job spec with the model: the 422 names the field."""
    with pytest.raises(ValidationError, match=r"labels\.team: contains a NUL"):
        JobSpec.model_validate({"job_id": "j", "team": "team-a", "queue": "team-a", "pod_sets": [{}],
                                "labels": {"team": "a\u0000"}})
    with pytest.raises(ValidationError, match=r"pod_sets\[0\]\.template\.volumes\[0\]\.csi\.driver: contains a lone"):
        JobSpec.model_validate({"job_id": "j", "team": "team-a", "queue": "team-a", "pod_sets": [
            {"template": {"image": "i", "volumes": [{"csi": {"driver": "\ud800"}}]}}]})
    with pytest.raises(ValidationError, match="message: contains a NUL"):
        JobFailed(job_id="j", message="oom\u0000", finished_at=T)
    assert unstorable({"a": ["fine", {"b": "\U0001f600"}]}) is None


def test_a_validator_meeting_an_unexpected_shape_is_an_invalid_payload() -> None:
    """A naive time against an aware one made the validator raise TypeError, which escaped parse_event."""
    event = make_event(JobAttemptFailed(job_id="j", attempt=1, attempts_allowed=3, exit_reason="Error",  # type: ignore[arg-type]
                                        finished_at=T, retry_not_before=T + timedelta(seconds=5)), source="t", time=T)
    doc = json.loads(encode_event(event))
    doc["data"]["retry_not_before"] = "2026-01-01T00:00:10"
    error = refused(body(doc))
    assert error.reason == "InvalidPayload" and "TypeError" in error.message


# ------------------------------------------------------------------------------ anything at all

_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=512) | st.text(max_size=256).map(str.encode))
def test_any_bytes_give_an_event_or_an_invalid_event(raw: bytes) -> None:
    try:
        parse_event(raw)
    except InvalidEvent as exc:
        assert "\x00" not in exc.message


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["spec", "submitted_at", "submitted_by", "unknown"]), value=_JSON,
       envelope=st.sampled_from(["id", "time", "type", "source", "subject", "data", "traceparent", "x"]),
       envelope_value=_JSON)
def test_a_valid_looking_envelope_with_any_data_gives_an_event_or_an_invalid_event(
        field: str, value: Any, envelope: str, envelope_value: Any) -> None:
    doc = submitted_doc()
    doc["data"][field] = value
    for raw in (body(doc), {**doc, envelope: envelope_value}):
        try:
            parse_event(raw)
        except InvalidEvent as exc:
            assert "\x00" not in exc.message
