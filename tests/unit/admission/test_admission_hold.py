"""The room a preemption counts on is held for the rest of the cycle only when its victims could free what it
lacks (docs/admission.md, "Reclaim"): a request whose candidates cannot cover its need, even all preempted,
cannot be met, and holding the cohort's free room for it kept that room idle (issue 15: on Philly October this
idle room put gpuq behind Kueue on average and p99 wait)."""

from __future__ import annotations

from services.core.admission import AdmissionState, admission_cycle
from shared.config import QueuesConfig
from shared.domain import CheckpointSpec
from tests.unit.admission.admission_core_builders import H100, config, job, queue, submit


def without_window(cfg: QueuesConfig) -> QueuesConfig:
    """No protection window: only the candidates' usage decides whether they can make room."""
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"protection_window_s": 0})})


def within_queue_case(low_gpus: int) -> AdmissionState:
    """q0 (4 GPUs) runs n0 (normal) and l0 (low, `low_gpus`), 4 in all; `lender` lends 2 free GPUs. q0's j (normal,
    4 GPUs) fits q0's nominal quota: it counts on the 2 free GPUs and asks its queue for the other 2, which only
    l0 (lower priority) may give. q3's b (low, 1 GPU) would borrow one of the free GPUs."""
    s = AdmissionState(without_window(config(queue("q0", {H100: 4}), queue("lender", {H100: 2}),
                                             queue("q3", {H100: 0}))))
    submit(s, job("n0", "q0", 4 - low_gpus), 0)
    submit(s, job("l0", "q0", low_gpus, priority="low"), 0)
    assert {a.spec.job_id for a in admission_cycle(s, 1).admitted} == {"n0", "l0"}
    submit(s, job("j", "q0", 4), 2)
    submit(s, job("b", "q3", 1, priority="low"), 3)
    return s


def test_the_free_room_is_held_for_a_within_queue_preemption_its_victims_can_make_room_for() -> None:
    s = within_queue_case(low_gpus=2)
    d = admission_cycle(s, 10)
    assert [(r.preemptor, r.need, r.candidates) for r in d.reclaims] == [("j", {H100: 2}, ("l0",))]
    assert d.admitted == []  # b would take a GPU j counts on: freeing l0 would leave j one short
    assert s.inadmissible("b") is None and "held for" in str(admission_cycle(s, 11).pending["b"].message)


def test_no_room_is_held_for_a_within_queue_preemption_its_victims_cannot_make_room_for() -> None:
    s = within_queue_case(low_gpus=1)
    d = admission_cycle(s, 10)
    # the request is still made (the preemption service answers it), but l0's 1 GPU can never free the 2 j
    # lacks, so nothing is held for it: b borrows a free GPU
    assert [(r.preemptor, r.need, r.candidates) for r in d.reclaims] == [("j", {H100: 2}, ("l0",))]
    assert [a.spec.job_id for a in d.admitted] == ["b"]


def reclaim_case(low_gpus: int) -> AdmissionState:
    """`lender` (4 GPUs) runs nothing; `a` (no quota) borrows 4 with a0 (normal) and a1 (low, `low_gpus`); `c`
    lends 1 more, free. The lender's j (normal, 3) fits its nominal quota: it counts on the free GPU and reclaims 2,
    which only a1 may give (reclaim_within_cohort: LowerPriority). q3's b (low, 1 GPU, checkpoints) would borrow the
    free one."""
    s = AdmissionState(without_window(config(queue("lender", {H100: 4}), queue("a", {H100: 0}),
                                             queue("c", {H100: 1}), queue("q3", {H100: 0}))))
    submit(s, job("a0", "a", 4 - low_gpus), 0)
    submit(s, job("a1", "a", low_gpus, priority="low"), 0)
    assert {a.spec.job_id for a in admission_cycle(s, 1).admitted} == {"a0", "a1"}
    submit(s, job("j", "lender", 3), 2)
    # b checkpoints: the waiting lender lends only to borrowers that give its quota back cheaply (lending.py)
    submit(s, job("b", "q3", 1, priority="low").model_copy(update={"checkpoint": CheckpointSpec(supported=True)}), 3)
    return s


def test_the_free_room_is_held_for_a_reclaim_its_victims_can_make_room_for() -> None:
    d = admission_cycle(reclaim_case(low_gpus=2), 10)
    assert [(r.preemptor, r.need, r.candidates) for r in d.reclaims] == [("j", {H100: 2}, ("a1",))]
    assert d.admitted == []


def test_no_room_is_held_for_a_reclaim_its_victims_cannot_make_room_for() -> None:
    d = admission_cycle(reclaim_case(low_gpus=1), 10)
    assert [(r.preemptor, r.need, r.candidates) for r in d.reclaims] == [("j", {H100: 2}, ("a1",))]
    assert [a.spec.job_id for a in d.admitted] == ["b"]


def borrow_within_case(low_gpus: int) -> AdmissionState:
    """team-a (4 GPUs, borrow_within_cohort under priority 0) wants 8; team-b (4) borrows 8 of team-c's with normal
    jobs and one low job of `low_gpus`; team-d lends 1 more, free, so 5 are free and a-big lacks 3, which only the
    low job may give. q3's b (low, 1 GPU) would borrow a free one."""
    a = queue("team-a", {H100: 4})
    a["preemption"]["borrow_within_cohort"] = {"policy": "LowerPriority", "max_priority_threshold": 0}
    s = AdmissionState(without_window(config(a, queue("team-b", {H100: 4}), queue("team-c", {H100: 8}),
                                             queue("team-d", {H100: 1}), queue("q3", {H100: 0}))))
    submit(s, job("b0", "team-b", 4), 0)
    submit(s, job("b1", "team-b", 4), 0)
    submit(s, job("b2", "team-b", 4 - low_gpus), 0)
    submit(s, job("b3", "team-b", low_gpus, priority="low"), 0)
    assert len(admission_cycle(s, 1).admitted) == 4 and s.usage("team-b") == {H100: 12}
    submit(s, job("a-big", "team-a", 8), 2)
    submit(s, job("b", "q3", 1, priority="low"), 3)
    return s


def test_the_free_room_is_held_for_a_borrow_within_cohort_request_its_victims_can_make_room_for() -> None:
    d = admission_cycle(borrow_within_case(low_gpus=3), 10)
    assert [(r.preemptor, r.need, r.candidates) for r in d.reclaims] == [("a-big", {H100: 3}, ("b3",))]
    assert d.admitted == []


def test_no_room_is_held_for_a_borrow_within_cohort_request_its_victims_cannot_make_room_for() -> None:
    d = admission_cycle(borrow_within_case(low_gpus=1), 10)
    assert [(r.preemptor, r.need, r.candidates) for r in d.reclaims] == [("a-big", {H100: 3}, ("b3",))]
    assert [a.spec.job_id for a in d.admitted] == ["b"]
