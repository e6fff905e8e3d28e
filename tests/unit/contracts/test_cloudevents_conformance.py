"""CloudEvents 1.0 held to the official Python SDK (`cloudevents` 2.x): every event type gpuq emits is read by the
SDK's JSON format, its `data` validates against the committed schema its `dataschema` names, and everything the
spec forbids is refused by `parse_event` with a dead-letter reason naming the attribute (the SDK refuses the same
envelopes, where it checks the rule at all)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import jsonschema
import pytest
from cloudevents.core.exceptions import BaseCloudEventException
from cloudevents.core.formats.json import JSONFormat

from shared.domain import GpuBinding, JobSpec, NodeSpec, PodSet, Precision
from shared.events import (
    BY_TYPE,
    CATALOGUE,
    AuditRecorded,
    CheckpointRequested,
    CloudEvent,
    ExecutorHeartbeat,
    ExitReason,
    GpuSample,
    InvalidEvent,
    JobAdmitted,
    JobApproved,
    JobAttemptFailed,
    JobCancelled,
    JobCancelRequested,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobFlopsReported,
    JobGrowRequested,
    JobIdleWarned,
    JobPending,
    JobPlaced,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobRequeued,
    JobResizeAdmitted,
    JobResized,
    JobStarted,
    JobSubmitted,
    NodeChanged,
    NodeInventory,
    Payload,
    PreemptionReason,
    PreemptionRequested,
    QueueConfigChanged,
    QueueUsageReported,
    UtilizationSampled,
    UtilizationSourceChecked,
    encode_event,
    make_event,
    parse_event,
    schema_uri,
)
from shared.schemas import ENVELOPE, schema_for_uri
from shared.tracing import traced_event

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SPEC = JobSpec(job_id="j1", team="team-a", queue="team-a", pod_sets=(PodSet(count=2, gpus_per_pod=4),))
NODE = NodeSpec(name="n1", gpus=8, gpu_model="H100-80GB", cpu_milli=96000, memory_mib=1 << 20, rack="r1", block="b1")


def one_of_each() -> list[Payload]:
    """An example of every event type of the catalogue."""
    return [
        JobSubmitted(spec=SPEC, submitted_at=T0),
        JobRejected(job_id="j1", team="team-a", queue="team-a", reason="Unauthorized", message="no"),
        JobQueued(job_id="j1", queue="team-a", team="team-a", position=1),
        JobPending(job_id="j1", queue="team-a", reason="QuotaExhausted", message="waits", eta=T0),
        JobAdmitted(job_id="j1", spec=SPEC, flavors={"main": "H100-80GB"}, quota={"H100-80GB": 8}, admitted_at=T0),
        JobPlaced(job_id="j1", spec=SPEC, bindings=(GpuBinding(pod="main-0", node="n1", gpu_indices=(0, 1, 2, 3)),),
                  placed_at=T0, fencing_token=3),
        JobStarted(job_id="j1", nodes=("n1",), started_at=T0),
        JobCompleted(job_id="j1", finished_at=T0),
        JobFailed(job_id="j1", exit_reason=ExitReason.OOM_KILLED, message="oom", finished_at=T0),
        JobAttemptFailed(job_id="j1", attempt=1, attempts_allowed=3, exit_reason=ExitReason.ERROR, message="exit 1",
                         finished_at=T0, retry_not_before=T0),
        JobCancelled(job_id="j1", by="alice", reason="typo", cancelled_at=T0),
        CheckpointRequested(job_id="j1", preemption_id="p1", deadline=T0),
        JobCheckpointed(job_id="j1", uri="s3://ckpt/j1/1", step=100, checkpointed_at=T0, preemption_id="p1"),
        JobPreempted(job_id="j1", reason=PreemptionReason.RECLAIM, preemptor="j2", lost_gpu_seconds=12.5,
                     preempted_at=T0),
        JobRequeued(job_id="j1", spec=SPEC, resume_from="s3://ckpt/j1/1", submitted_at=T0),
        JobIdleWarned(job_id="j1", team="team-a", user="alice", idle_since=T0, deadline=T0, action="requeue",
                      message="j1's GPUs have been below 5% for 1800s; it is requeued in 900s unless they are used"),
        PreemptionRequested(preemptor="j2", queue="team-b", reason=PreemptionReason.PRIORITY, need={"H100-80GB": 8}),
        UtilizationSampled(node="n1", gpu_model="H100-80GB", sampled_at=T0, interval_s=15, source="dcgm",
                           samples=(GpuSample(job_id="j1", gpu_index=0, utilization_pct=87.5, memory_used_mib=1000,
                                              power_w=500.0),
                                    GpuSample(job_id="j1", gpu_index=1, gpu_instance=7, mig_profile="1g.10gb",
                                              utilization_pct=50.0, tensor_active_pct=20.0, fb_free_mib=9000,
                                              gpu_uuid="GPU-5c1d", approximate=True))),
        NodeInventory(nodes=(NODE,)),
        NodeChanged(node=NODE, change="added"),
        ExecutorHeartbeat(executor="executor/sim", running=("j1", "j2"), sent_at=T0, interval_s=10.0),
        QueueConfigChanged(config={"queues": []}, changed_by="admin"),
        QueueUsageReported(at=T0, half_life_s=604800, usage={"team-a": {"H100-80GB": 3600.0}}),
        JobCancelRequested(job_id="j1", requested_by="alice", reason="typo", requested_at=T0),
        JobApproved(job_id="j1", approved_by="admin:carol", approved_at=T0),
        AuditRecorded(action="submit", actor="team:team-a", at=T0, job_id="j1", team="team-a",
                      detail={"queue": "team-a"}),
        UtilizationSourceChecked(source="dcgm", endpoint="http://prometheus:9090", ok=False, reason="Unreachable",
                                 message="cannot reach Prometheus", checked_at=T0, interval_s=15),
        JobFlopsReported(job_id="j1", achieved_tflops=1582.4, precision=Precision.BF16, reported_at=T0, step=100),
        JobGrowRequested(job_id="j1", pods_before=2, pods=3),
        JobResizeAdmitted(job_id="j1", pods=3, quota={"H100-80GB": 12}),
        JobResized(job_id="j1", spec=SPEC, bindings=(GpuBinding(pod="main-0", node="n1", gpu_indices=(0, 1, 2, 3)),),
                   pods_before=2, pods=1, reason="Shrink", for_job="j2", fencing_token=3),
    ]


def test_the_examples_cover_the_catalogue() -> None:
    assert sorted(type(p).__name__ for p in one_of_each()) == sorted(c.__name__ for c in CATALOGUE)


@pytest.mark.parametrize("payload", one_of_each(), ids=lambda p: type(p).event_type())
def test_every_event_type_is_read_by_the_official_sdk(payload: Payload) -> None:
    event = traced_event(payload, source="gpuq/test/0", time=T0)
    body = encode_event(event)
    sdk_event = JSONFormat().read(None, body)
    assert sdk_event.get_specversion() == "1.0"
    assert sdk_event.get_id() == event.id and sdk_event.get_type() == payload.event_type()
    assert sdk_event.get_time() == T0 and sdk_event.get_source() == "gpuq/test/0"
    assert sdk_event.get_dataschema() == schema_uri(payload.event_type())
    assert sdk_event.get_extension("traceparent") == event.traceparent
    assert sdk_event.get_data() == json.loads(body)["data"]
    # The SDK writes it back; gpuq reads that as the same event.
    again, again_payload = parse_event(JSONFormat().write(sdk_event))
    assert again.id == event.id and again_payload == payload


@pytest.mark.parametrize("payload", one_of_each(), ids=lambda p: type(p).event_type())
def test_data_validates_against_the_schema_dataschema_names(payload: Payload) -> None:
    doc = json.loads(encode_event(make_event(payload, source="gpuq/test/0", time=T0)))
    schema = schema_for_uri(doc["dataschema"])
    assert schema["$id"] == doc["dataschema"]
    jsonschema.validate(doc["data"], schema)
    jsonschema.validate(doc, schema_for_uri(schema_uri(ENVELOPE)))


def test_schema_uris_resolve_only_to_committed_files() -> None:
    for event_type in BY_TYPE:
        assert schema_for_uri(schema_uri(event_type))["$id"] == schema_uri(event_type)
    for bad in ("https://gpuq.io/schemas/io.gpuq.job.exploded.v1.json", "https://example.com/x.json",
                "https://gpuq.io/schemas/../pyproject.json"):
        with pytest.raises(KeyError, match="no committed gpuq schema"):
            schema_for_uri(bad)


def test_the_envelope_schema_requires_what_the_spec_requires() -> None:
    envelope = schema_for_uri(schema_uri(ENVELOPE))
    assert set(envelope["required"]) == {"specversion", "id", "source", "type", "time", "data"}
    assert envelope["properties"]["specversion"]["const"] == "1.0"
    assert envelope["propertyNames"] == {"pattern": "^[a-z0-9]+$"}
    for name in ("id", "source", "type", "specversion"):
        assert envelope["properties"][name]["minLength"] == 1


def valid_doc() -> dict[str, Any]:
    return json.loads(encode_event(traced_event(JobCompleted(job_id="j1", finished_at=T0), source="gpuq/t/0", time=T0)))


# Each: what is changed in a valid event, the dead-letter reason, and a fragment of the message naming the problem.
FORBIDDEN: list[tuple[str, dict[str, Any], str, str]] = [
    ("empty id", {"id": ""}, "MalformedEnvelope", "id:"),
    ("empty source", {"source": ""}, "MalformedEnvelope", "source:"),
    ("empty type", {"type": ""}, "MalformedEnvelope", "type:"),
    ("no specversion", {"specversion": None}, "MalformedEnvelope", "specversion: Field required"),
    ("other specversion", {"specversion": "0.3"}, "UnsupportedSpecVersion", "0.3"),
    ("time with a space and no zone", {"time": "2026-11-30 12:00"}, "MalformedEnvelope", "RFC 3339"),
    ("time without a zone", {"time": "2026-11-30T12:00:00"}, "MalformedEnvelope", "RFC 3339"),
    ("time as a number", {"time": 1764504000}, "MalformedEnvelope", "RFC 3339"),
    ("extension name with upper case and _", {"Bad_Ext": "x"}, "MalformedEnvelope", "'Bad_Ext'"),
    ("extension name with -", {"my-ext": "x"}, "MalformedEnvelope", "'my-ext'"),
    ("extension valued with an object", {"myext": {"a": 1}}, "MalformedEnvelope", "string, an integer or a boolean"),
    ("extension valued with a fraction", {"myext": 1.5}, "MalformedEnvelope", "string, an integer or a boolean"),
    ("empty subject", {"subject": ""}, "MalformedEnvelope", "subject:"),
    ("source that is no URI-reference", {"source": "gpuq admission"}, "MalformedEnvelope", "URI-reference"),
    ("relative dataschema", {"dataschema": "schemas/x.json"}, "MalformedEnvelope", "absolute URI"),
    ("dataschema of another type", {"dataschema": schema_uri("io.gpuq.job.submitted.v1")}, "MalformedEnvelope",
     "is not the schema of io.gpuq.job.completed.v1"),
    ("data that is not JSON", {"datacontenttype": "text/plain"}, "MalformedEnvelope", "JSON media type"),
    ("binary data", {"data": None, "data_base64": "AAEC"}, "MalformedEnvelope", "data"),
]


@pytest.mark.parametrize(("change", "reason", "fragment"), [f[1:] for f in FORBIDDEN], ids=[f[0] for f in FORBIDDEN])
def test_what_the_spec_forbids_is_refused_with_a_reason(change: dict[str, Any], reason: str, fragment: str) -> None:
    doc = valid_doc()
    for key, value in change.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    with pytest.raises(InvalidEvent) as info:
        parse_event(json.dumps(doc))
    assert info.value.reason == reason
    assert fragment in info.value.message


# (The SDK also reads CloudEvents 0.3, which gpuq does not accept.)
SDK_ALSO_REFUSES = ["empty id", "empty source", "empty type", "time with a space and no zone",
                    "time without a zone", "extension name with upper case and _", "extension name with -",
                    "empty subject"]


@pytest.mark.parametrize("case", SDK_ALSO_REFUSES)
def test_the_official_sdk_refuses_those_envelopes_too(case: str) -> None:
    change = next(f[1] for f in FORBIDDEN if f[0] == case)
    doc = {**valid_doc(), **change}
    with pytest.raises((BaseCloudEventException, ValueError)):
        JSONFormat().read(None, json.dumps(doc).encode())


def test_null_attributes_are_absent_and_valid_extensions_pass() -> None:
    doc = {**valid_doc(), "subject": None, "partitionkey": "team-a", "sequence2": 7, "replayed": True}
    event, _ = parse_event(json.dumps(doc))
    assert event.subject is None
    assert event.model_extra == {"partitionkey": "team-a", "sequence2": 7, "replayed": True}


def test_make_event_refuses_a_naive_time_and_keeps_the_zone_it_is_given() -> None:
    with pytest.raises(ValueError, match="has no zone"):
        make_event(JobCompleted(job_id="j1", finished_at=T0), source="t", time=datetime(2026, 11, 30, 12, 0))
    plus2 = timezone(timedelta(hours=2))
    event = make_event(JobCompleted(job_id="j1", finished_at=T0), source="t", time=T0.astimezone(plus2))
    assert json.loads(encode_event(event))["time"] == "2026-11-30T14:00:00+02:00"
    assert JSONFormat().read(None, encode_event(event)).get_time() == T0


def test_an_envelope_built_in_python_is_held_to_the_same_rules() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        CloudEvent(specversion="1.0", id="x", source="s", type="t", time=datetime(2026, 1, 1), data={})
