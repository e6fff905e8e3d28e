"""Preemption within a queue, and with a reclaim in the same decision (Kueue `withinClusterQueue: LowerPriority`,
pkg/scheduler/preemption/preemption.go): admission asks for it; the preemption core picks the victims."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.core.admission import AdmissionState, Reason, Workload, admission_cycle
from services.core.admission.within_queue import own_candidates
from shared.domain import CheckpointSpec
from tests.unit.admission.admission_core_builders import A100, H100, config, job, queue, submit


def _queue(name: str, nominal: int, within: str = "LowerPriority", reclaim: str = "LowerPriority",
           cohort: str | None = "research") -> dict[str, Any]:
    q = queue(name, {H100: nominal}, cohort=cohort, reclaim=reclaim)
    q["preemption"]["within_queue"] = within
    return q


def at_quota(within: str = "LowerPriority") -> AdmissionState:
    """team-a (no cohort, nominal 8) runs two 4-GPU low-priority jobs."""
    s = AdmissionState(config(_queue("team-a", 8, within, cohort=None)))
    for i in range(2):
        submit(s, job(f"low{i}", "team-a", 4, priority="low"), float(i))
        admission_cycle(s, 10.0 + i)
    assert s.usage("team-a") == {H100: 8}
    return s


def test_a_high_priority_job_preempts_its_own_queues_low_priority_job_when_the_queue_is_at_its_quota() -> None:
    s = at_quota()
    submit(s, job("boss", "team-a", 4, priority="normal"), 100)
    d = admission_cycle(s, 101.0)
    assert not d.admitted
    [r] = d.reclaims
    assert (r.preemptor, r.queue, r.reason) == ("boss", "team-a", Reason.PRIORITY_PREEMPTION)
    assert r.need == {H100: 4} and r.own_need == {H100: 4}
    assert r.candidates == ("low1", "low0")  # most recently admitted first
    st = d.pending["boss"]
    assert st.reason == Reason.WAITING_FOR_PREEMPTION and "within_queue: LowerPriority" in st.message
    # once a victim is gone, the job is admitted within its nominal quota
    s.finish("low1")
    assert [a.job_id for a in admission_cycle(s, 102.0).admitted] == ["boss"]


def test_no_within_queue_request_for_equal_priority_or_within_queue_never() -> None:
    s = at_quota()
    submit(s, job("peer", "team-a", 4, priority="low"), 100)
    d = admission_cycle(s, 101.0)
    assert d.reclaims == [] and d.pending["peer"].reason == Reason.WAITING_FOR_QUOTA
    s = at_quota(within="Never")
    submit(s, job("boss", "team-a", 4, priority="normal"), 100)
    assert admission_cycle(s, 101.0).reclaims == []


def test_a_job_larger_than_its_nominal_quota_asks_nothing_of_its_queue() -> None:
    s = AdmissionState(config(_queue("team-a", 8), _queue("team-b", 8)))
    for i in range(2):
        submit(s, job(f"low{i}", "team-a", 4, priority="low"), float(i))
        submit(s, job(f"b{i}", "team-b", 4, priority="low"), float(i))
    admission_cycle(s, 10.0)
    submit(s, job("huge", "team-a", 4, count=3, priority="normal"), 100)  # 12 > nominal 8: must borrow
    d = admission_cycle(s, 101.0)
    assert d.reclaims == [] and d.pending["huge"].reason == Reason.WAITING_FOR_BORROWABLE_QUOTA


def test_one_within_queue_request_per_queue_and_cycle() -> None:
    s = at_quota()
    submit(s, job("boss0", "team-a", 4, priority="normal"), 100)
    submit(s, job("boss1", "team-a", 4, priority="normal"), 101)
    d = admission_cycle(s, 102.0)
    assert [r.preemptor for r in d.reclaims] == ["boss0"]
    assert "waits behind this queue's preemption for boss0" in d.pending["boss1"].message


def test_preempt_in_the_queue_and_reclaim_from_a_borrower_in_the_same_decision() -> None:
    """Kueue's case: team-a, under its nominal quota, needs more than its nominal headroom; the cohort's lendable
    quota is all borrowed. One request frees its own low-priority job and reclaims from team-b's borrowers."""
    s = AdmissionState(config(_queue("team-a", 8), _queue("team-b", 8)))
    submit(s, job("a-low", "team-a", 4, priority="low"), 0)
    admission_cycle(s, 1.0)
    for i in range(3):
        submit(s, job(f"b{i}", "team-b", 4, priority="low"), 2.0 + i)
        admission_cycle(s, 3.0 + i)
    assert s.usage("team-a") == {H100: 4} and s.usage("team-b") == {H100: 12}
    submit(s, job("a-boss", "team-a", 8, priority="normal"), 100)
    d = admission_cycle(s, 101.0)
    assert not d.admitted
    [r] = d.reclaims
    assert r.reason == Reason.RECLAIM_QUOTA and r.need == {H100: 8}
    assert r.own_need == {H100: 4}  # so that team-a ends within its nominal quota, not borrowing
    assert r.candidates == ("b2", "b1", "b0", "a-low")  # borrowers first (Kueue's order), then its own queue
    assert d.pending["a-boss"].reason == Reason.WAITING_FOR_RECLAIM
    s.finish("a-low")
    s.finish("b2")
    assert [a.job_id for a in admission_cycle(s, 102.0).admitted] == ["a-boss"]


def _borrowing_cohort(threshold: int | None) -> AdmissionState:
    """team-a (nominal 4) wants 8; team-b (nominal 4) has borrowed team-c's idle 8 with low-priority jobs."""
    a = _queue("team-a", 4)
    a["preemption"]["borrow_within_cohort"] = {"policy": "LowerPriority", "max_priority_threshold": threshold}
    s = AdmissionState(config(a, _queue("team-b", 4), _queue("team-c", 8)))
    for i in range(3):
        submit(s, job(f"b{i}", "team-b", 4, priority="low"), float(i))
        admission_cycle(s, 1.0 + i)
    assert s.usage("team-b") == {H100: 12}
    return s


def test_borrow_within_cohort_preempts_lower_priority_borrowers_in_order_to_borrow() -> None:
    s = _borrowing_cohort(threshold=0)
    submit(s, job("a-big", "team-a", 8, priority="normal"), 100)
    d = admission_cycle(s, 101.0)
    [r] = d.reclaims
    assert (r.preemptor, r.reason, r.need, r.max_victim_priority) == ("a-big", Reason.RECLAIM_QUOTA, {H100: 4}, 0)
    assert r.candidates == ("b2", "b1", "b0")
    assert d.pending["a-big"].reason == Reason.WAITING_FOR_RECLAIM
    s.finish("b2")
    assert [a.job_id for a in admission_cycle(s, 102.0).admitted] == ["a-big"]


def test_borrow_within_cohort_respects_its_threshold_and_is_off_by_default() -> None:
    s = _borrowing_cohort(threshold=-1)  # the borrowers' priority 0 is above the threshold
    submit(s, job("a-big", "team-a", 8, priority="normal"), 100)
    assert admission_cycle(s, 101.0).reclaims == []
    s = AdmissionState(config(_queue("team-a", 4), _queue("team-b", 4), _queue("team-c", 8)))
    for i in range(3):
        submit(s, job(f"b{i}", "team-b", 4, priority="low"), float(i))
        admission_cycle(s, 1.0 + i)
    submit(s, job("a-big", "team-a", 8, priority="normal"), 100)
    d = admission_cycle(s, 101.0)
    assert d.reclaims == [] and d.pending["a-big"].reason == Reason.WAITING_FOR_BORROWABLE_QUOTA


# a checkpointing job admitted before one that cannot checkpoint, of the same priority: most recently admitted
# first, unless checkpointing jobs go first
@example([("submit", "a", 1, (H100,), "normal", True), ("cycle",), ("submit", "a", 1, (H100,), "normal", False),
          ("cycle",)])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(["a", "b"]), st.integers(1, 4),
              st.sampled_from([(H100,), (A100,), (H100, A100)]), st.sampled_from(["low", "normal", "high"]),
              st.booleans()),
    st.tuples(st.just("cycle")), st.tuples(st.just("finish"), st.integers(0, 99)),
    st.tuples(st.just("requeue"), st.integers(0, 99)), st.tuples(st.just("loss_aware"), st.booleans())),
    min_size=3, max_size=40))
def test_kept_candidates_in_order_are_the_scan_of_the_admitted_jobs(ops: list[tuple]) -> None:
    """AdmittedIndex keeps each queue's preemptible admitted jobs in candidate order as they are admitted and
    released (and rebuilt on a new configuration); what it answers is the scan-and-sort of within_queue.py
    `own_candidates` over the queue's admitted jobs, for every priority and need, checkpointing first or not."""
    def cfg(loss_aware: bool) -> Any:
        return config(queue("a", {H100: 6, A100: 2}), queue("b", {H100: 2}, cohort=None),
                      policy={"loss_aware_reclaim": loss_aware})

    s = AdmissionState(cfg(False))
    for i, o in enumerate(ops):
        if o[0] == "submit":
            _, q, gpus, models, priority, checkpoints = o
            s.submit(Workload(job(f"j{i}", q, gpus, models=models, priority=priority).model_copy(
                update={"checkpoint": CheckpointSpec(supported=checkpoints)}), float(i)))
        elif o[0] == "cycle":
            admission_cycle(s, float(i))
        elif o[0] in ("finish", "requeue") and s.admitted:
            victim = sorted(s.admitted)[o[1] % len(s.admitted)]
            if o[0] == "finish":
                s.finish(victim)
            else:
                a = s.admitted[victim]
                s.requeue(Workload(a.spec, a.submitted_at))
        elif o[0] == "loss_aware":
            s.set_config(cfg(o[1]))
        for qq in s.book.queues.values():
            for priority in (0, 100, 101, 500, 1000):
                for need in ({H100: 1}, {A100: 2}, {H100: 1, A100: 1}):
                    # the kept answer (the configuration's order), then the ordered read in either order
                    assert s.own_candidates(qq, priority, need) == own_candidates(
                        s.admitted_entries(qq.name), qq, priority, need, ckpt_first=s.config.policy.loss_aware_reclaim)
                    for ckpt_first in (False, True):
                        assert s._admitted_index._candidates(qq, priority, need, ckpt_first) == \
                            own_candidates(s.admitted_entries(qq.name), qq, priority, need, ckpt_first=ckpt_first)
