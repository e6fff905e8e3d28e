"""Which submissions of a consumed batch the batch-start lookup may answer (services/admission/prefetch.py): only
a job's first message of the batch, and none after an event about no single job."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from services.admission.prefetch import Known, served_submissions, take
from shared.domain import JobSpec, PodSet
from shared.events import CloudEvent, JobCancelRequested, JobCompleted, JobSubmitted, QueueConfigChanged, make_event

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _submitted(job_id: str, team: str = "team-a") -> tuple[CloudEvent, Any, str]:
    spec = JobSpec(job_id=job_id, team=team, queue=team, pod_sets=(PodSet(count=1, gpus_per_pod=1),))
    payload = JobSubmitted(spec=spec, submitted_at=T0)
    return make_event(payload, source="test", time=T0), payload, f"{JobSubmitted.subject()}.{team}"


def _other(payload: Any, subject: str) -> tuple[CloudEvent, Any, str]:
    return make_event(payload, source="test", time=T0), payload, subject


def test_each_jobs_first_submission_is_served_with_the_subjects_team() -> None:
    batch = [_submitted("a"), _submitted("b", "team-b"), _submitted("a")]
    assert served_submissions(batch) == [("a", "team-a"), ("b", "team-b")]


def test_a_submission_after_another_message_about_its_job_is_not_served() -> None:
    cancel = _other(JobCancelRequested(job_id="late", requested_by="bob"), JobCancelRequested.subject() + ".team-a")
    ended = _other(JobCompleted(job_id="done", finished_at=T0), JobCompleted.subject())
    batch = [cancel, ended, _submitted("late"), _submitted("done"), _submitted("fresh")]
    assert served_submissions(batch) == [("fresh", "team-a")]


def test_nothing_after_an_event_about_no_single_job_is_served() -> None:
    change = _other(QueueConfigChanged(config={"queues": []}, changed_by="admin"), QueueConfigChanged.subject())
    assert served_submissions([_submitted("x"), change, _submitted("y")]) == [("x", "team-a")]


def test_an_answer_is_taken_once_and_only_for_its_team() -> None:
    scratch: dict[str, Any] = {"admission-submission-lookup": {("a", "team-a"): Known("admitted", "team-a", False)}}
    assert take(scratch, "a", "team-b") is None
    assert take(scratch, "a", "team-a") == Known("admitted", "team-a", False)
    assert take(scratch, "a", "team-a") is None
    assert take({}, "a", "team-a") is None
