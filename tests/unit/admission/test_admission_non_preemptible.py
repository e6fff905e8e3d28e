"""Guarantees that cannot be opted out of for free (issue 43 item 5).

A job nobody may preempt keeps whatever it holds for as long as it runs. On borrowed quota that is a loan its
lender can never take back: a lender with 8 guaranteed GPUs got 4 of its 8 jobs running against borrowers that had
set `preemptible: false`, against 8 without the flag. So a non-preemptible job never borrows (it must fit its own
queue's nominal quota), and opting out of preemption in a preemptible class needs an admin's approval unless the
class allows it (`allow_non_preemptible`)."""

from __future__ import annotations

from typing import Any

import pytest

from services.core.admission import AdmissionDecision, AdmissionState, Reason, Workload, admission_cycle
from services.core.admission.approval import approval_reason, opts_out_of_preemption
from shared.config import QueuesConfig, TeamPolicy, parse_queues
from shared.domain import CheckpointSpec
from tests.unit.admission.admission_core_builders import CLASSES, H100, config, job, queue, submit


def preempt(s: AdmissionState, d: AdmissionDecision) -> list[str]:
    """What the preemption service does with each reclaim: requeue candidates in order until the need is covered
    (it never takes a non-preemptible job; admission names none)."""
    taken = []
    for r in d.reclaims:
        freed: dict[str, int] = {}
        for victim in r.candidates:
            if all(freed.get(k, 0) >= n for k, n in r.need.items()):
                break
            a = s.admitted.get(victim)
            if a is None:
                continue
            assert s.preemptible(victim), f"{victim} is not preemptible but was named a reclaim candidate"
            for k, n in a.usage.items():
                freed[k] = freed.get(k, 0) + n
            s.requeue(Workload(a.spec, a.submitted_at))
            taken.append(victim)
    return taken


def lender_story(borrower_preemptible: bool | None) -> AdmissionState:
    """team-a guarantees 8 GPUs (lending_limit 0 would forbid loans: it lends them all while idle); team-b (nominal
    4) fills the idle cohort with 12 one-GPU jobs of the lender's priority, then team-a submits its 8 jobs. Reclaims
    are carried out as the preemption service would."""
    s = AdmissionState(config(queue("team-a", {H100: 8}, reclaim="Any"), queue("team-b", {H100: 4})))
    for i in range(12):
        submit(s, job(f"b{i}", "team-b", preemptible=borrower_preemptible), float(i))
    admission_cycle(s, 20.0)
    for i in range(8):
        submit(s, job(f"a{i}", "team-a"), 30.0 + i)
    for t in range(40, 60):
        preempt(s, admission_cycle(s, float(t)))
    return s


@pytest.mark.parametrize("flag", [None, False], ids=["no-flag", "preemptible-false"])
def test_a_lender_gets_its_guaranteed_quota_whatever_the_borrowers_flag(flag: bool | None) -> None:
    s = lender_story(flag)
    running_a = sorted(j for j in s.admitted if j.startswith("a"))
    assert running_a == [f"a{i}" for i in range(8)], f"the lender runs {len(running_a)} of its 8 guaranteed jobs"
    assert s.usage("team-a") == {H100: 8} and s.usage("team-b") == {H100: 4}


def test_non_preemptible_borrowers_hold_no_loan_at_any_time() -> None:
    s = lender_story(False)
    # before the lender came, team-b's non-preemptible jobs took only its own nominal 4, even with 8 idle to borrow
    s2 = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: 4})))
    for i in range(12):
        submit(s2, job(f"b{i}", "team-b", preemptible=False), float(i))
    d = admission_cycle(s2, 20.0)
    assert len(d.admitted) == 4 and not any(a.borrowing for a in d.admitted)
    assert s2.borrowed("team-b") == {} and s.borrowed("team-b") == {}
    st = d.pending["b4"]
    assert st.reason == Reason.WAITING_FOR_QUOTA
    assert "not preemptible, so it never borrows" in st.message


def test_the_same_request_borrows_when_preemptible_and_waits_when_not() -> None:
    """One request shape, three reasons to borrow or not, in one queue: each job gets its own verdict and message
    (the fit memo keeps them apart)."""
    q = queue("team-b", {H100: 4})
    q["max_borrow_runtime_without_checkpoint_s"] = 3600
    s = AdmissionState(config(queue("team-a", {H100: 8}), q))
    submit(s, job("b-own", "team-b", 4), 0.0)
    admission_cycle(s, 1.0)  # team-b's nominal quota is used: anything more borrows
    no_ckpt = job("b-nockpt", "team-b", 2).model_copy(update={"checkpoint": CheckpointSpec(supported=False)})
    submit(s, job("b-pinned", "team-b", 2, preemptible=False), 2.0)
    submit(s, no_ckpt, 3.0)
    submit(s, job("b-free", "team-b", 2).model_copy(update={"checkpoint": CheckpointSpec(supported=True)}), 4.0)
    d = admission_cycle(s, 5.0)
    assert [a.job_id for a in d.admitted] == ["b-free"] and d.admitted[0].borrowing
    assert "not preemptible" in d.pending["b-pinned"].message
    assert "cannot checkpoint" in d.pending["b-nockpt"].message
    assert "not preemptible" not in d.pending["b-nockpt"].message


@pytest.mark.parametrize("priority,preemptible", [("high", None), ("production", None), ("normal", False)])
def test_no_non_preemptible_job_borrows_whatever_makes_it_so(priority: str, preemptible: bool | None) -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: 2})))
    submit(s, job("b0", "team-b", 2, priority=priority, preemptible=preemptible), 0.0)
    submit(s, job("b1", "team-b", 2, priority=priority, preemptible=preemptible), 1.0)
    d = admission_cycle(s, 2.0)
    assert [a.job_id for a in d.admitted] == ["b0"] and not d.admitted[0].borrowing
    assert d.pending["b1"].reason == Reason.WAITING_FOR_QUOTA


def test_a_production_named_class_never_borrows_even_if_its_spec_says_preemptible() -> None:
    """The preemption service never takes a `prod*` class's job (priority_of): admission judges it the same."""
    classes = [*CLASSES[1:], {"name": "prod-batch", "value": 900, "preemptible": True}]
    cfg = parse_queues({"priority_classes": classes, "cohorts": [{"name": "research"}],
                        "queues": [queue("team-a", {H100: 8}), queue("team-b", {H100: 2})]})
    s = AdmissionState(cfg)
    rejection = s.submit(Workload(job("b0", "team-b", 4, priority="prod-batch", preemptible=True), 0.0))
    assert rejection is not None and rejection.reason == Reason.EXCEEDS_LIMITS
    assert s.preemptible("b0") is None


def test_a_non_preemptible_request_above_the_nominal_quota_is_rejected_at_submit() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: 4})))
    rejection = s.submit(Workload(job("big", "team-b", 6, preemptible=False), 0.0))
    assert rejection is not None and rejection.reason == Reason.EXCEEDS_LIMITS
    assert "not preemptible, so it never borrows" in rejection.message and "at most 4" in rejection.message
    assert s.submit(Workload(job("big-ok", "team-b", 6), 0.0)) is None  # preemptible: it may borrow the 2


def test_a_non_preemptible_job_still_reclaims_its_own_nominal_quota() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: 4})))
    for i in range(6):
        submit(s, job(f"b{i}", "team-b", 2, priority="low"), float(i))
    admission_cycle(s, 10.0)
    assert s.borrowed("team-b") == {H100: 8}
    submit(s, job("a-pinned", "team-a", 8, preemptible=False), 20.0)
    for t in range(21, 25):
        preempt(s, admission_cycle(s, float(t)))
    assert "a-pinned" in s.admitted and not s.admitted["a-pinned"].borrowing


def test_a_class_made_non_preemptible_by_a_config_change_stops_its_waiting_jobs_borrowing() -> None:
    def cfg(normal_preemptible: bool) -> QueuesConfig:
        classes = [dict(c) for c in CLASSES]
        classes[2]["preemptible"] = normal_preemptible  # "normal"
        return parse_queues({"priority_classes": classes, "cohorts": [{"name": "research"}],
                             "queues": [queue("team-a", {H100: 8}), queue("team-b", {H100: 2})]})

    s = AdmissionState(cfg(True))
    submit(s, job("b0", "team-b", 2), 0.0)
    submit(s, job("b1", "team-b", 2), 1.0)
    s.set_config(cfg(False))
    d = admission_cycle(s, 2.0)
    assert [a.job_id for a in d.admitted] == ["b0"] and s.preemptible("b1") is False
    assert "never borrows" in d.pending["b1"].message


# ----------------------------------------------------------------------------- governance: the opt-out's price


def _cfg(**normal: Any) -> QueuesConfig:
    classes = [dict(c) for c in CLASSES]
    classes[2].update(normal)  # "normal"
    return parse_queues({"priority_classes": classes, "queues": [queue("team-a", cohort=None)]})


def test_opting_out_of_preemption_needs_approval_by_default() -> None:
    cfg = _cfg()
    assert cfg.priority_class_map["normal"].allow_non_preemptible is False  # safe by default
    reason = approval_reason(job("j", "team-a", preemptible=False), TeamPolicy(), cfg)
    assert reason is not None and "preemptible: false" in reason and "allow_non_preemptible" in reason
    assert approval_reason(job("j", "team-a"), TeamPolicy(), cfg) is None
    assert approval_reason(job("j", "team-a", preemptible=True), TeamPolicy(), cfg) is None


def test_a_class_that_allows_it_or_is_never_preempted_needs_no_approval() -> None:
    cfg = _cfg(allow_non_preemptible=True)
    assert approval_reason(job("j", "team-a", preemptible=False), TeamPolicy(), cfg) is None
    # production and high are never preempted anyway: saying so again is no opt-out
    for klass in ("production", "high"):
        spec = job("j", "team-a", priority=klass, preemptible=False)
        assert not opts_out_of_preemption(spec, cfg) and approval_reason(spec, TeamPolicy(), cfg) is None


def test_the_default_class_is_judged_for_a_spec_that_names_none() -> None:
    """A spec's built-in class "normal" is the configuration's default class when one is set (as priority_of reads
    it); that class's rule applies."""
    classes = [*CLASSES[:2], {"name": "batch", "value": 50, "preemptible": True, "allow_non_preemptible": True}]
    cfg = parse_queues({"priority_classes": classes, "default_priority_class": "batch",
                        "queues": [queue("team-a", cohort=None)]})
    assert approval_reason(job("j", "team-a", preemptible=False), TeamPolicy(), cfg) is None


def test_approval_required_classes_still_apply() -> None:
    cfg = _cfg()
    reason = approval_reason(job("j", "team-a", priority="production"),
                             TeamPolicy(approval_required_classes=("production",)), cfg)
    assert reason == "priority class production needs a platform admin's approval"


def test_allow_non_preemptible_is_checked_like_the_rest_of_the_class() -> None:
    from shared.config import ConfigError

    with pytest.raises(ConfigError, match="allow_non_preemptible"):
        _cfg(allow_non_preemptible="sometimes")
