"""Lending while the lender waits (issue 15 item 4): a queue's unused quota is not lent to a job it could not
take back while that queue has jobs waiting within its nominal quota (the issue reports Kueue refuses too)."""

from __future__ import annotations

from typing import Any

from services.core.admission import AdmissionState, Reason, Workload, admission_cycle
from shared.domain import CheckpointSpec, JobSpec
from tests.unit.admission.admission_core_builders import H100, config, job, queue, submit


def _checkpointing(spec: JobSpec) -> JobSpec:
    return spec.model_copy(update={"checkpoint": CheckpointSpec(supported=True, interval_s=1800)})


def _state(reclaim: str = "LowerPriority", *extra: dict[str, Any], loss_aware: bool = False) -> AdmissionState:
    """team-a (nominal 8, one job at a time) runs a 1-GPU job and has a 4-GPU job waiting for its turn."""
    s = AdmissionState(config(queue("team-a", {H100: 8}, max_running_jobs=1, reclaim=reclaim),
                              queue("team-b", {H100: 0}), *extra, policy={"loss_aware_reclaim": loss_aware}))
    submit(s, job("a-run", "team-a", 1), 0)
    submit(s, job("a-wait", "team-a", 4), 1)
    d = admission_cycle(s, 2.0)
    assert [a.job_id for a in d.admitted] == ["a-run"]
    return s


def test_no_loan_the_lender_could_not_take_back_while_its_jobs_wait() -> None:
    s = _state()
    submit(s, job("b-peer", "team-b", 4), 10)  # same priority: team-a's LowerPriority reclaim could not take it
    d = admission_cycle(s, 11.0)
    assert not d.admitted
    st = d.pending["b-peer"]
    assert st.reason == Reason.WAITING_FOR_BORROWABLE_QUOTA
    assert "team-a" in st.message and "reclaim_within_cohort" in st.message
    # a loan team-a can take back cheaply is made: a lower-priority borrower that checkpoints
    submit(s, _checkpointing(job("b-low", "team-b", 4, priority="low")), 12)
    assert [a.job_id for a in admission_cycle(s, 13.0).admitted] == ["b-low"]
    # and once team-a's waiting job is admitted, its unused quota is lent again
    s.finish("a-run")
    assert [a.job_id for a in admission_cycle(s, 14.0).admitted] == ["a-wait"]
    assert [a.job_id for a in admission_cycle(s, 15.0).admitted] == []  # 8 = 4 (a-wait) + 4 (b-low): all used
    s.finish("b-low")
    assert [a.job_id for a in admission_cycle(s, 16.0).admitted] == ["b-peer"]


def test_a_waiting_lender_lends_only_to_borrowers_that_give_back_cheaply() -> None:
    """Issue 49: a borrower team-a could take back, but only by throwing away its run (it cannot checkpoint and
    is predicted to run past the protection window, the earliest a reclaim can take it), is lent nothing while
    team-a waits; one that checkpoints, or is predicted to end within the window, is (`loss_aware_reclaim` on)."""
    s = _state(loss_aware=True)
    submit(s, job("b-long", "team-b", 4, priority="low"), 10)  # no checkpoint, 24 h limit, no prediction
    d = admission_cycle(s, 11.0)
    assert not d.admitted
    st = d.pending["b-long"]
    assert st.reason == Reason.WAITING_FOR_BORROWABLE_QUOTA
    assert "team-a" in st.message and "cannot checkpoint" in st.message and "600s protection window" in st.message
    # its limit is its predicted run unless admission was given a prediction: predicted 5 min on 4 GPUs
    s.submit(Workload(job("b-short", "team-b", 4, priority="low"), 12, predicted_gpu_s=4 * 300.0))
    assert [a.job_id for a in admission_cycle(s, 13.0).admitted] == ["b-short"]
    s.finish("b-short")
    # a limit within the window gives it back as cheaply
    submit(s, job("b-limited", "team-b", 4, priority="low").model_copy(update={"max_runtime_s": 600}), 14)
    assert [a.job_id for a in admission_cycle(s, 15.0).admitted] == ["b-limited"]
    s.finish("b-limited")
    # predicted past the window: still refused
    s.submit(Workload(job("b-later", "team-b", 4, priority="low"), 16, predicted_gpu_s=4 * 3600.0))
    assert "b-later" not in [a.job_id for a in admission_cycle(s, 17.0).admitted]
    # a checkpointing one is lent (the queue's waiting job is still owed, so this is the rule, not idle quota)
    submit(s, _checkpointing(job("b-ckpt", "team-b", 4, priority="low")), 18)
    assert [a.job_id for a in admission_cycle(s, 19.0).admitted] == ["b-ckpt"]


def test_without_loss_aware_reclaim_a_waiting_lender_lends_to_any_job_it_could_take_back() -> None:
    # the default (policy.loss_aware_reclaim off): the borrower that cannot checkpoint is lent team-a's idle quota,
    # as before issue 49 (team-a could take it back, at the cost of its run)
    s = _state()
    submit(s, job("b-long", "team-b", 4, priority="low"), 10)
    assert [a.job_id for a in admission_cycle(s, 11.0).admitted] == ["b-long"]


def test_with_no_lender_waiting_any_preemptible_job_borrows() -> None:
    # nothing waits in team-a: its idle quota is lent to a job that cannot checkpoint (no need is known)
    s = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: 0})))
    submit(s, job("b-long", "team-b", 4, priority="low"), 0)
    assert [a.job_id for a in admission_cycle(s, 1.0).admitted] == ["b-long"]


def test_a_lender_that_can_reclaim_any_borrower_lends() -> None:
    s = _state(reclaim="Any")
    submit(s, _checkpointing(job("b-peer", "team-b", 4)), 10)
    assert [a.job_id for a in admission_cycle(s, 11.0).admitted] == ["b-peer"]
    # but not to a job nobody may preempt: it never borrows, and team-b has no quota of its own
    rejection = s.submit(Workload(job("b-pinned", "team-b", 2, preemptible=False), 12))
    assert rejection is not None and rejection.reason == Reason.EXCEEDS_LIMITS
    assert "not preemptible, so it never borrows" in rejection.message


def test_other_lenders_still_lend() -> None:
    s = _state("LowerPriority", queue("team-c", {H100: 4}))
    submit(s, job("b-peer", "team-b", 4), 10)
    assert [a.job_id for a in admission_cycle(s, 11.0).admitted] == ["b-peer"]  # team-c's idle 4
    submit(s, job("b-more", "team-b", 1), 12)
    assert admission_cycle(s, 13.0).pending["b-more"].reason == Reason.WAITING_FOR_BORROWABLE_QUOTA


def test_a_lender_whose_waiting_jobs_would_themselves_borrow_still_lends() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: 8})))
    submit(s, job("a-big", "team-a", 12), 0)
    submit(s, job("b-big", "team-b", 12), 1)
    d = admission_cycle(s, 2.0)
    assert [a.job_id for a in d.admitted] == ["a-big"]  # no deadlock: each would have held back the other


def test_a_held_queue_admits_nothing_keeps_its_running_jobs_and_holds_back_no_loan() -> None:
    s = _state()
    held = config(queue("team-a", {H100: 8}, max_running_jobs=1) | {"stop_policy": "Hold"},
                  queue("team-b", {H100: 0}))
    assert s.set_config(held) is not None
    s.finish("a-run")
    submit(s, job("b-peer", "team-b", 4), 10)
    d = admission_cycle(s, 11.0)
    assert [a.job_id for a in d.admitted] == ["b-peer"]  # team-a's waiting job no longer holds its quota back
    st = d.pending["a-wait"]
    assert st.reason == Reason.QUEUE_HELD and "stop_policy: Hold" in st.message
    s.set_config(config(queue("team-a", {H100: 8}, max_running_jobs=1), queue("team-b", {H100: 0})))
    assert [a.job_id for a in admission_cycle(s, 12.0).admitted] == ["a-wait"]


def test_hold_and_drain_holds_like_hold_and_says_it_drains() -> None:
    s = _state()
    s.set_config(config(queue("team-a", {H100: 8}, max_running_jobs=1) | {"stop_policy": "HoldAndDrain"},
                        queue("team-b", {H100: 0})))
    s.finish("a-run")
    d = admission_cycle(s, 11.0)
    assert d.admitted == []
    st = d.pending["a-wait"]
    assert st.reason == Reason.QUEUE_HELD and "stop_policy: HoldAndDrain" in st.message and "drained" in st.message
