"""Reclaim: a queue under its nominal quota takes back what borrowers hold (reason ReclaimQuota)."""

from __future__ import annotations

from services.core.admission import AdmissionState, Reason, admission_cycle
from shared.domain import CheckpointSpec
from tests.unit.admission.admission_core_builders import (
    H100,
    config,
    job,
    queue,
    restore_borrower,
    submit,
    submit_many,
)


def borrowed_by_b(reclaim: str = "LowerPriority", **jobs_kw) -> AdmissionState:  # type: ignore[no-untyped-def]
    """team-b (nominal 4) has borrowed all 8 idle GPUs of team-a."""
    s = AdmissionState(config(queue("team-a", {H100: 8}, reclaim=reclaim), queue("team-b", {H100: 4})))
    for i in range(6):
        submit(s, job(f"b{i}", "team-b", 2, **jobs_kw), float(i))
        admission_cycle(s, 10.0 + i)  # one admission per cycle: distinct admission times
    assert s.usage("team-b") == {H100: 12} and s.borrowed("team-b") == {H100: 8}
    return s


def test_reclaim_request_names_borrowers_lowest_priority_then_newest() -> None:
    s = borrowed_by_b(priority="low")
    submit(s, job("a0", "team-a", 6), 100)
    d = admission_cycle(s, 101.0)
    assert not d.admitted
    [r] = d.reclaims
    assert (r.preemptor, r.queue, r.need, r.reason) == ("a0", "team-a", {H100: 6}, "ReclaimQuota")
    assert r.candidates == ("b5", "b4", "b3", "b2", "b1", "b0")  # most recently admitted first
    st = d.pending["a0"]
    assert st.reason == Reason.WAITING_FOR_RECLAIM
    assert "team-a uses 0/8" in st.message and "8 borrowed by other queues" in st.message


def test_need_is_only_the_shortfall() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: 4}), queue("c", {H100: 2})))
    submit_many(s, "team-b", 7, 2, priority="low")  # 14 = 4 own + 8 of a + 2 of c
    admission_cycle(s, 0.0)
    s.finish("team-b-6")  # frees 2
    submit(s, job("a0", "team-a", 5), 10)
    d = admission_cycle(s, 11.0)
    assert d.reclaims[0].need == {H100: 3}


def test_lower_priority_policy_spares_equal_priority_borrowers() -> None:
    s = borrowed_by_b()
    submit(s, job("a0", "team-a", 2), 100)
    d = admission_cycle(s, 101.0)
    assert d.reclaims == []
    st = d.pending["a0"]
    assert st.reason == Reason.WAITING_FOR_QUOTA and "none is lower-priority preemptible" in st.message


def test_any_policy_reclaims_equal_priority() -> None:
    s = borrowed_by_b(reclaim="Any")
    submit(s, job("a0", "team-a", 2), 100)
    assert admission_cycle(s, 101.0).reclaims[0].candidates[0] == "b5"


def test_never_policy_does_not_reclaim() -> None:
    s = borrowed_by_b(reclaim="Never", priority="low")
    submit(s, job("a0", "team-a", 2), 100)
    d = admission_cycle(s, 101.0)
    assert d.reclaims == [] and d.pending["a0"].reason == Reason.WAITING_FOR_QUOTA


def test_non_preemptible_borrowers_are_not_candidates() -> None:
    # A non-preemptible job never borrows now; one admitted on borrowed quota before that (restored from the store)
    # is still nobody's victim.
    s = AdmissionState(config(queue("team-a", {H100: 8}, reclaim="Any"), queue("team-b", {H100: 4})))
    for i in range(6):
        restore_borrower(s, job(f"b{i}", "team-b", 2, preemptible=False), float(i))
    assert s.usage("team-b") == {H100: 12} and s.borrowed("team-b") == {H100: 8}
    submit(s, job("a0", "team-a", 2), 100)
    assert admission_cycle(s, 101.0).reclaims == []


def test_several_reclaims_in_one_cycle_name_disjoint_victims() -> None:
    s = borrowed_by_b(priority="low")
    submit(s, job("a0", "team-a", 2), 100)
    submit(s, job("a1", "team-a", 3), 101)
    d = admission_cycle(s, 102.0)
    assert [(r.preemptor, r.need) for r in d.reclaims] == [("a0", {H100: 2}), ("a1", {H100: 3})]
    assert d.reclaims[0].candidates[0] == "b5"
    assert "b5" not in d.reclaims[1].candidates and d.reclaims[1].candidates[:2] == ("b4", "b3")
    assert {st.reason for st in d.pending.values()} == {Reason.WAITING_FOR_RECLAIM}


def test_reclaim_needs_add_up_and_stop_at_the_nominal_quota() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: 4})))
    submit_many(s, "team-b", 6, 2, priority="low")  # 12 = 4 + 8 borrowed
    admission_cycle(s, 0.0)
    s.finish("team-b-5")  # 2 lendable now
    submit_many(s, "team-a", 4, 3, t0=10)  # 12 > nominal 8: only two of them can reclaim
    d = admission_cycle(s, 11.0)
    assert [a.job_id for a in d.admitted] == []
    # a0 lacks 1 (2 lendable); the 2-GPU victim earmarked for it frees 1 more than that, so a1 lacks 2
    assert [(r.preemptor, r.need) for r in d.reclaims] == [("team-a-0", {H100: 1}), ("team-a-1", {H100: 2})]
    assert "waits behind this queue's reclaims (team-a-0)" in d.pending["team-a-2"].message


def test_a_job_that_must_borrow_does_not_reclaim() -> None:
    s = borrowed_by_b(priority="low")
    submit(s, job("a-big", "team-a", 10), 100)  # above team-a's nominal 8: it would borrow, not reclaim
    d = admission_cycle(s, 101.0)
    assert d.reclaims == []
    assert d.pending["a-big"].reason == Reason.WAITING_FOR_BORROWABLE_QUOTA


def test_candidates_come_only_from_queues_above_nominal() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: 4}), queue("team-c", {H100: 4})))
    submit_many(s, "team-c", 2, 2, priority="low")  # within its nominal
    submit_many(s, "team-b", 6, 2, priority="low", t0=10)  # 12 = 4 + 8 borrowed
    admission_cycle(s, 20.0)
    assert s.usage("team-b") == {H100: 12} and s.usage("team-c") == {H100: 4}
    submit(s, job("a0", "team-a", 8), 30)
    [r] = admission_cycle(s, 31.0).reclaims
    assert r.need == {H100: 8}
    assert set(r.candidates) == {f"team-b-{i}" for i in range(6)}


def test_a_job_that_cannot_checkpoint_borrows_only_within_its_queues_runtime_limit() -> None:
    """The risk of a reclaim throwing work away is taken at borrowing time: team-b lets its jobs that cannot
    checkpoint borrow only when they are limited to an hour; within nominal quota nothing changes."""
    b = queue("team-b", {H100: 4})
    b["max_borrow_runtime_without_checkpoint_s"] = 3600
    s = AdmissionState(config(queue("team-a", {H100: 16}), b))  # plenty to lend
    short = job("short", "team-b", 4).model_copy(update={"max_runtime_s": 3600})
    long = job("long", "team-b", 4).model_copy(update={"max_runtime_s": 7200})
    saved = long.model_copy(update={"job_id": "saved", "checkpoint": CheckpointSpec(supported=True)})
    within = long.model_copy(update={"job_id": "within"})
    submit(s, within, 0)
    submit(s, long, 1)
    submit(s, short, 2)
    submit(s, saved, 3)
    d = admission_cycle(s, 10.0)
    assert sorted(a.job_id for a in d.admitted) == ["saved", "short", "within"]  # `within` uses nominal quota
    st = d.pending["long"]
    assert st.reason == Reason.WAITING_FOR_QUOTA
    assert "cannot checkpoint" in st.message and "3600s" in st.message
    assert admission_cycle(s, 20.0).pending["long"].reason == Reason.WAITING_FOR_QUOTA  # not just this cycle


def test_reclaim_candidates_name_the_checkpointing_borrowers_first_within_a_priority() -> None:
    """Issue 49: within a priority, the borrowers that checkpoint come first (a reclaim costs them their checkpoint
    write; the others lose their run), then the most recently admitted. This cycle's later requests are earmarked
    the rest, so the first request gets the cheap victims."""
    s = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: 4}),
                              policy={"loss_aware_reclaim": True}))
    saving = CheckpointSpec(supported=True, interval_s=1800)
    for i in range(6):
        spec = job(f"b{i}", "team-b", 2, priority="low")
        if i in (1, 3):
            spec = spec.model_copy(update={"checkpoint": saving})
        submit(s, spec, float(i))
        admission_cycle(s, 10.0 + i)
    submit(s, job("a0", "team-a", 6), 100)
    [r] = admission_cycle(s, 101.0).reclaims
    assert r.candidates == ("b3", "b1", "b5", "b4", "b2", "b0")
