"""Submit-time validation and tenant authorisation: every rejection names its reason and the facts."""

from __future__ import annotations

from services.core.admission import AdmissionState, Reason, Workload
from shared.domain import PodSet
from tests.unit.admission.admission_core_builders import A100, H100, config, job, queue, quota, submit


def state() -> AdmissionState:
    return AdmissionState(config(
        queue("team-a", {H100: quota(8, borrowing_limit=4)}, teams=("team-a",)),
        queue("team-b", {H100: 8}),
        queue("solo", {A100: 4}, cohort=None),
    ))


def test_open_queue_accepts_any_team() -> None:
    s = state()
    assert s.submit(Workload(job("j1", "team-b", team="someone-else"), 0)) is None
    assert "j1" in s.pending


def test_team_not_listed_is_unauthorized() -> None:
    r = state().submit(Workload(job("j1", "team-a", team="team-b"), 0))
    assert r is not None and r.reason == Reason.UNAUTHORIZED
    assert "team-b" in r.message and "team-a" in r.message


def test_unknown_queue() -> None:
    r = state().submit(Workload(job("j1", "nope"), 0))
    assert r is not None and r.reason == Reason.UNKNOWN_QUEUE
    assert "nope" in r.message and "team-a" in r.message  # lists the queues that exist


def test_unknown_priority_class() -> None:
    r = state().submit(Workload(job("j1", "team-b", priority="urgent"), 0))
    assert r is not None and r.reason == Reason.UNKNOWN_PRIORITY_CLASS
    assert "urgent" in r.message


def test_no_acceptable_flavor() -> None:
    r = state().submit(Workload(job("j1", "team-b", models=(A100,)), 0))
    assert r is not None and r.reason == Reason.NO_FLAVOR
    assert A100 in r.message and H100 in r.message


def test_any_model_job_takes_queue_flavors() -> None:
    s = state()
    assert s.submit(Workload(job("j1", "solo", 2, models=()), 0)) is None


def test_exceeds_nominal_plus_borrowing_limit() -> None:
    s = state()
    # team-a: nominal 8 + borrowing limit 4 = 12 at most, even with team-b idle
    assert s.submit(Workload(job("ok", "team-a", 12), 0)) is None
    r = s.submit(Workload(job("big", "team-a", 13), 0))
    assert r is not None and r.reason == Reason.EXCEEDS_LIMITS
    assert "12" in r.message


def test_exceeds_without_cohort_is_nominal() -> None:
    r = state().submit(Workload(job("big", "solo", 5, models=(A100,)), 0))
    assert r is not None and r.reason == Reason.EXCEEDS_LIMITS


def test_exceeds_counts_all_pod_sets_on_one_model() -> None:
    spec = job("two", "solo", pod_sets=(PodSet(name="a", count=1, gpus_per_pod=3, gpu_models=(A100,)),
                                        PodSet(name="b", count=1, gpus_per_pod=3, gpu_models=(A100,))))
    r = state().submit(Workload(spec, 0))
    assert r is not None and r.reason == Reason.EXCEEDS_LIMITS


def test_cpu_only_job_needs_no_flavor() -> None:
    s = state()
    assert s.submit(Workload(job("cpu", "solo", 0, models=()), 0)) is None


def test_resubmit_same_spec_is_idempotent_and_other_spec_rejected() -> None:
    s = state()
    submit(s, job("j1", "team-b"), 1.0)
    assert s.submit(Workload(job("j1", "team-b"), 5.0)) is None
    assert s.pending["j1"].submitted_at == 1.0
    r = s.submit(Workload(job("j1", "team-b", 2), 5.0))
    assert r is not None and r.reason == Reason.DUPLICATE_JOB_ID


def test_preemptible_from_class_and_spec_override() -> None:
    s = state()
    submit(s, job("p", "team-b", priority="production"))
    submit(s, job("n", "team-b", priority="normal"))
    submit(s, job("o", "team-b", priority="normal", preemptible=False))
    assert (s.priority("p"), s.preemptible("p")) == (1000, False)
    assert (s.priority("n"), s.preemptible("n")) == (100, True)
    assert s.preemptible("o") is False


def test_finish_is_idempotent_and_forgets_pending() -> None:
    s = state()
    submit(s, job("j1", "team-b"))
    s.finish("j1")
    s.finish("j1")
    s.finish("never-seen")
    assert "j1" not in s.pending
