"""Event contracts: committed schemas, the envelope, and precise rejection of bad events."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from shared import namespace
from shared.bus import streams
from shared.domain import JobSpec, PodSet
from shared.events import (
    BY_TYPE,
    CATALOGUE,
    InvalidEvent,
    JobSubmitted,
    encode_event,
    make_event,
    parse_event,
)
from shared.schemas import SCHEMA_DIR, current_schemas, render, schema_path

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("event_type", sorted(current_schemas()))
def test_committed_schema_matches_model(event_type: str) -> None:
    path = schema_path(event_type)
    assert path.exists(), f"{path.name} is missing: run `make schemas` and commit it"
    assert path.read_text() == render(current_schemas()[event_type]), (
        f"the schema of {event_type} changed without its committed file: if the change is additive and "
        "deliberate, run `make schemas` and commit the file; otherwise it breaks v1 consumers")


def test_no_stale_schema_files() -> None:
    known = {schema_path(t).name for t in current_schemas()}
    on_disk = {p.name for p in SCHEMA_DIR.glob("*.json")}
    assert on_disk == known


def test_types_and_subjects_follow_the_naming_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {cls.__name__ for cls in CATALOGUE if cls.channel} == {"JobPending"}
    session_namespace = namespace.current()
    for cls in CATALOGUE:
        assert cls.event_type() == f"io.gpuq.{cls.aggregate}.{cls.fact}.v1"
        channel = f"{cls.channel}." if cls.channel else ""  # status news travel apart: `<ns>.status.job.pending`
        assert cls.subject() == f"{session_namespace}.{channel}{cls.aggregate}.{cls.fact}"
    monkeypatch.delenv(namespace.ENV)  # the default namespace keeps the historical subjects
    for cls in CATALOGUE:
        channel = f"{cls.channel}." if cls.channel else ""
        assert cls.subject() == f"gpuq.{channel}{cls.aggregate}.{cls.fact}"
        assert cls.event_type() == f"io.gpuq.{cls.aggregate}.{cls.fact}.v1"
    assert len(BY_TYPE) == len(CATALOGUE)


def test_stream_names_carry_the_namespace() -> None:
    assert [s.name for s in streams("gpuq")] == ["GPUQ_JOBS", "GPUQ_PREEMPTION", "GPUQ_CLUSTER",
                                                  "GPUQ_UTILIZATION", "GPUQ_DLQ", "GPUQ_AUDIT", "GPUQ_STATUS"]
    assert streams("gpuq")[2].subjects == ("gpuq.node.>", "gpuq.queue.>")
    assert streams("demo-1f")[0].name == "DEMO_1F_JOBS"
    assert streams("demo-1f")[0].subjects == ("demo-1f.job.>",)
    for bad in ("GPUQ", "a.b", "a_b", "", "1abc", "x" * 40):
        with pytest.raises(namespace.NamespaceError, match="invalid gpuq namespace"):
            streams(bad)


def spec() -> JobSpec:
    return JobSpec(job_id="j1", team="team-a", queue="team-a", pod_sets=(PodSet(count=2, gpus_per_pod=4),))


def test_roundtrip_through_the_envelope() -> None:
    event = make_event(JobSubmitted(spec=spec()), source="test", time=T0)
    envelope, payload = parse_event(encode_event(event))
    assert envelope.specversion == "1.0" and envelope.subject == "j1"
    assert isinstance(payload, JobSubmitted) and payload.spec.total_gpus == 8


@pytest.mark.parametrize(("raw", "reason", "fragment"), [
    (b"{oops", "MalformedJson", "not JSON"),
    (b"[1, 2]", "MalformedEnvelope", "not a JSON object"),
    (json.dumps({"specversion": "1.0", "id": "x", "source": "s", "type": "io.gpuq.job.submitted.v1",
                 "time": "2026-01-01T00:00:00Z"}), "MalformedEnvelope", "data"),
    (json.dumps({"specversion": "0.3", "id": "x", "source": "s", "type": "io.gpuq.job.submitted.v1",
                 "time": "2026-01-01T00:00:00Z", "data": {}}), "UnsupportedSpecVersion", "0.3"),
    (json.dumps({"specversion": "1.0", "id": "x", "source": "s", "type": "io.gpuq.job.exploded.v1",
                 "time": "2026-01-01T00:00:00Z", "data": {}}), "UnknownEventType", "io.gpuq.job.exploded.v1"),
    (json.dumps({"specversion": "1.0", "id": "x", "source": "s", "type": "io.gpuq.job.submitted.v1",
                 "time": "2026-01-01T00:00:00Z",
                 "data": {"spec": {"job_id": "j", "team": "t", "queue": "q", "pod_sets": [{"count": 0}]}}}),
     "InvalidPayload", "spec.pod_sets.0.count"),
])
def test_bad_events_are_rejected_with_a_precise_reason(raw: bytes | str, reason: str, fragment: str) -> None:
    with pytest.raises(InvalidEvent) as info:
        parse_event(raw)
    assert info.value.reason == reason
    assert fragment in info.value.message


def test_job_spec_rules() -> None:
    with pytest.raises(ValueError, match="min_members"):
        JobSpec(job_id="j", team="t", queue="q", pod_sets=(PodSet(count=2),), min_members=3)
    with pytest.raises(ValueError, match="unique"):
        JobSpec(job_id="j", team="t", queue="q", pod_sets=(PodSet(name="a"), PodSet(name="a")))
    with pytest.raises(ValueError, match="mig_profile"):
        PodSet(mig_profile="1g.10gb", gpus_per_pod=2)
    mig = JobSpec(job_id="j", team="t", queue="q", pod_sets=(PodSet(count=3, mig_profile="1g.10gb"),))
    assert mig.total_gpus == 0 and mig.total_mig_slices == 3
    multi = JobSpec(job_id="j", team="t", queue="q", pod_sets=(
        PodSet(name="a", gpu_models=("H100", "A100")), PodSet(name="b", gpu_models=("A100",))))
    assert multi.gpu_models == ("A100",)
