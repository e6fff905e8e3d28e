"""`parse_event` builds the envelope of the plain shape gpuq's publishers write without the model's validators
(`_plain_envelope`): it must give the envelope the model gives, and leave to the model everything else, so that a
document the model refuses is still refused with the model's reason."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from shared.events import (
    CloudEvent,
    InvalidEvent,
    JobStarted,
    _plain_envelope,
    encode_event,
    make_event,
    parse_event,
)


def _doc(**changes: Any) -> dict[str, Any]:
    event = make_event(JobStarted(job_id="j-1", started_at=datetime(2026, 12, 1, 12, tzinfo=UTC)),
                       source="gpuq/executor/0", time=datetime(2026, 12, 1, 12, 0, 1, 250000, tzinfo=UTC),
                       traceparent="00-0123456789abcdef0123456789abcdef-0123456789abcdef-01")
    doc: dict[str, Any] = json.loads(encode_event(event))
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not ...}


@pytest.mark.parametrize("changes", [
    {}, {"subject": None}, {"dataschema": ...}, {"traceparent": ...}, {"datacontenttype": ...},
    {"time": "2026-12-01T12:00:00Z"}, {"time": "2026-12-01T12:00:00.5Z"},
    {"datacontenttype": "application/cloudevents+json; charset=utf-8"},
])
def test_the_plain_shape_gives_the_models_envelope(changes: dict[str, Any]) -> None:
    doc = _doc(**changes)
    plain = _plain_envelope(doc)
    assert plain is not None
    model = CloudEvent.model_validate(doc)
    assert plain == model
    assert plain.model_fields_set == model.model_fields_set
    assert encode_event(plain) == encode_event(model)


@pytest.mark.parametrize("changes", [
    {"time": "2026-12-01T12:00:00+01:00"},  # valid, but not UTC: the model reads it
    {"time": "2026-13-01T12:00:00Z"}, {"time": "2026-12-01T12:00:60Z"}, {"time": "2026-12-01 12:00:00Z"},
    {"time": "2026-12-01T12:00:00.1234567Z"},
    {"source": "gpuq/executor/0\n"}, {"source": "a b"}, {"source": ""}, {"id": ""}, {"id": 7},
    {"subject": ""}, {"dataschema": "not a uri"}, {"datacontenttype": "text/plain"},
    {"specversion": "0.3"}, {"data": [1]}, {"data": ...}, {"traceparent": 5},
    {"partitionkey": "team-a"},  # an extension attribute: the model checks its name and value
    {"data_base64": "AAAA"},
])
def test_anything_else_is_left_to_the_model(changes: dict[str, Any]) -> None:
    assert _plain_envelope(_doc(**changes)) is None


@pytest.mark.parametrize(("changes", "reason"), [
    ({"time": "2026-13-01T12:00:00Z"}, "MalformedEnvelope"), ({"source": "gpuq/executor/0\n"}, "MalformedEnvelope"),
    ({"id": ""}, "MalformedEnvelope"), ({"data": [1]}, "MalformedEnvelope"),
    ({"specversion": "0.3"}, "UnsupportedSpecVersion"), ({"type": "io.gpuq.job.nothing.v1"}, "UnknownEventType"),
])
def test_what_the_model_refuses_is_still_refused(changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidEvent) as refused:
        parse_event(json.dumps(_doc(**changes)).encode())
    assert refused.value.reason == reason
