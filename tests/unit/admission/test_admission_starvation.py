"""The starvation rule in the admission core (core/starvation.py): a queue under its nominal quota whose oldest job
waited past max(K x its class's median, floor) is admitted in strict order; off, later small jobs pass it."""

from __future__ import annotations

from services.core.admission import AdmissionState, Reason, Workload, admission_cycle
from services.core.admission.starvation import StarvationWatch, under_guarantee
from shared.config import QueuesConfig
from tests.unit.admission.admission_core_builders import H100, config, job, queue


def _config(factor: float | None) -> QueuesConfig:
    base = config(queue("a", {H100: 4}, cohort=None))
    return base.model_copy(update={"policy": base.policy.model_copy(
        update={"starvation_factor": factor, "starvation_min_wait_s": 100})})


def _scenario(factor: float | None) -> tuple[AdmissionState, list[str]]:
    state = AdmissionState(_config(factor))
    state.submit(Workload(job("small-1", "a"), 0.0))
    assert [a.job_id for a in admission_cycle(state, 0.0).admitted] == ["small-1"]  # waited 0: the median is 0
    state.submit(Workload(job("big", "a", gpus=4), 1.0))  # 4 GPUs: does not fit beside small-1
    state.submit(Workload(job("small-2", "a"), 2.0))
    assert [a.job_id for a in admission_cycle(state, 2.0).admitted] == ["small-2"]  # big has not starved yet
    state.submit(Workload(job("small-3", "a"), 200.0))  # big waited 199 s >= max(10 x 0, 100); usage 2 < 4
    return state, [a.job_id for a in admission_cycle(state, 200.0).admitted]


def test_a_starved_job_blocks_later_jobs_of_its_queue_and_says_why() -> None:
    state, admitted = _scenario(10.0)
    assert admitted == []
    status = admission_cycle(state, 201.0).pending
    assert status["small-3"].reason == Reason.WAITING_IN_STRICT_FIFO
    assert "big" in str(status["small-3"].message) and "starvation" in str(status["small-3"].message)
    state.finish("small-1")
    state.finish("small-2")
    assert [a.job_id for a in admission_cycle(state, 300.0).admitted] == ["big"]


def test_without_the_rule_later_small_jobs_pass_it() -> None:
    _, admitted = _scenario(None)
    assert admitted == ["small-3"]


def test_the_watch_medians_requeues_and_guarantee() -> None:
    w = StarvationWatch()
    for wait in (10.0, 30.0, 20.0, 1000.0):
        w.admitted("j", 100, wait)
    assert w.median(100) == 25.0 and w.median(0) == 0.0
    assert w.threshold(100, 10.0, 100.0) == 250.0 and w.threshold(0, 10.0, 100.0) == 100.0
    w.pending("a", "requeued", 0.0, requeued=True)  # a preempted job: not judged, its next admission not recorded
    w.admitted("requeued", 100, 99_999.0)
    assert w.median(100) == 25.0
    assert under_guarantee({H100: 2}, {H100: 4}) and not under_guarantee({H100: 4}, {H100: 4})
    assert not under_guarantee({H100: 5, "x": 0}, {H100: 4, "x": 1})
    copy = w.copy()
    copy.admitted("k", 100, 0.0)
    assert w.median(100) == 25.0  # the copy is independent (the ETA's what-if state)
