"""Duration-aware ordering (services/core/admission/ordering.py): among jobs of the same priority, shorter
predicted GPU-time first; a longer job is passed only by jobs submitted within its own offset (aging)."""

from __future__ import annotations

import pytest

from services.core.admission import AdmissionState, Workload, admission_cycle
from services.core.admission.ordering import order_time
from tests.unit.admission.admission_core_builders import H100, config, job, queue


def one_gpu_queue() -> AdmissionState:
    return AdmissionState(config(queue("a", {H100: 1}, cohort=None)))


def admitted(state: AdmissionState, now: float) -> list[str]:
    return [a.job_id for a in admission_cycle(state, now).admitted]


def test_a_shorter_predicted_job_goes_first_among_jobs_submitted_together() -> None:
    state = one_gpu_queue()
    state.submit(Workload(job("long", "a"), 0.0, predicted_gpu_s=10_000.0))
    state.submit(Workload(job("short", "a"), 5.0, predicted_gpu_s=100.0))
    assert admitted(state, 10.0) == ["short"]  # 5 + 100 < 0 + 10,000


def test_aging_a_long_job_is_passed_only_by_jobs_submitted_within_its_offset() -> None:
    state = one_gpu_queue()
    state.submit(Workload(job("long", "a"), 0.0, predicted_gpu_s=10_000.0))
    state.submit(Workload(job("later", "a"), 10_001.0, predicted_gpu_s=1.0))  # after long's offset
    assert admitted(state, 10_002.0) == ["long"]


def test_priority_still_comes_first_and_no_prediction_is_fifo() -> None:
    state = one_gpu_queue()
    state.submit(Workload(job("short-low", "a", priority="low"), 0.0, predicted_gpu_s=1.0))
    state.submit(Workload(job("long-high", "a", priority="high"), 5.0, predicted_gpu_s=1e9))
    assert admitted(state, 10.0) == ["long-high"]
    fifo = one_gpu_queue()
    fifo.submit(Workload(job("first", "a"), 0.0))
    fifo.submit(Workload(job("second", "a"), 5.0))
    assert admitted(fifo, 10.0) == ["first"]


def test_order_time_divides_by_the_queue_quota_or_the_jobs_own_gpus() -> None:
    assert order_time(100.0, None, 8, 1) == 100.0
    assert order_time(100.0, 800.0, 8, 1) == pytest.approx(200.0)  # 800 GPU-s on a queue of 8 GPUs
    assert order_time(100.0, 800.0, 0, 4) == pytest.approx(300.0)  # no quota: the job's own 4 GPUs
    with pytest.raises(ValueError, match="predicted_gpu_s"):
        order_time(0.0, -1.0, 8, 1)
