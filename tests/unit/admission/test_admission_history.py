"""Fair share over time (services/core/admission/history.py): a queue that borrowed in the past waits behind one
that did not, at equal priority; the memory fades with the half-life; no history changes nothing."""

from __future__ import annotations

import math

import pytest

from services.core.admission import AdmissionState, admission_cycle
from tests.unit.admission.admission_core_builders import H100, config, job, queue, submit

DAY = 86_400.0


def cohort() -> AdmissionState:
    # a and b: 2 GPUs each; c lends 4 and is idle. a's and b's 5-GPU jobs each borrow 3: only one fits (8 in all).
    state = AdmissionState(config(queue("a", {H100: 2}), queue("b", {H100: 2}), queue("c", {H100: 4})))
    submit(state, job("a-job", "a", 5), 0.0)
    submit(state, job("b-job", "b", 5), 0.0)
    return state


def test_without_history_the_tie_goes_by_submit_time_and_id() -> None:
    assert [a.job_id for a in admission_cycle(cohort(), 1.0).admitted] == ["a-job"]


def test_a_queue_that_borrowed_last_week_waits_behind_one_that_did_not() -> None:
    state = cohort()
    tau = 7 * DAY / math.log(2)
    state.set_usage_history({"a": {H100: 6 * tau}}, half_life_s=7 * DAY)  # a averaged 6 GPUs: borrowed 4
    assert state.history_share("a") == pytest.approx(4 * 1000 / 8)
    assert [x.job_id for x in admission_cycle(state, 1.0).admitted] == ["b-job"]


def test_use_within_nominal_quota_leaves_no_mark() -> None:
    state = cohort()
    tau = 7 * DAY / math.log(2)
    state.set_usage_history({"a": {H100: 2 * tau}}, half_life_s=7 * DAY)  # a used exactly its own 2 GPUs
    assert state.history_share("a") == 0.0
    assert [x.job_id for x in admission_cycle(state, 1.0).admitted] == ["a-job"]


def test_a_bad_half_life_is_refused() -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        cohort().set_usage_history({}, half_life_s=0)
