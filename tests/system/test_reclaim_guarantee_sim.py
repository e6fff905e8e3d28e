"""The quota guarantee, replayed by the simulator on the production cores (sim policy `gpuq`): team A borrows
team B's idle nominal quota with long jobs that cannot checkpoint; when B submits within its nominal quota, it
gets it within the checkpoint grace and the protection window, whatever the unsaved-work bound says."""

from __future__ import annotations

from typing import Any

import pytest

from shared.config import parse_queues
from shared.domain import NodeSpec
from sim.engine import Engine
from sim.model import Trace, TraceJob
from sim.run import make_policy

MODEL = "H100-80GB"
HOUR = 3600


def _trace(b_submits_at: int, *, window: int, max_loss: int | None, a_checkpoints: bool = False,
           extra: dict[str, Any] | None = None) -> Trace:
    queues = parse_queues({
        "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
        "cohorts": [{"name": "research"}],
        "queues": [
            {"name": "team-a", "cohort": "research", "quotas": {MODEL: {"nominal": 8}}, **(extra or {})},
            # B takes its quota back from any borrower (Kueue's reclaimWithinCohort: Any)
            {"name": "team-b", "cohort": "research", "quotas": {MODEL: {"nominal": 8}},
             "preemption": {"reclaim_within_cohort": "Any"}},
        ],
        "policy": {"protection_window_s": window, "checkpoint_grace_s": 300, "max_victim_loss_s": max_loss},
    })
    nodes = [NodeSpec(name=f"n-{i}", gpus=8, gpu_model=MODEL, cpu_milli=96000, memory_mib=1 << 20,
                      rack="r-0", block="b-0") for i in range(2)]
    interval = 600 if a_checkpoints else None
    jobs = [TraceJob(job_id=f"a-{i}", submit_time=0, duration=10 * HOUR, team="team-a", queue="team-a",
                     pods=1, gpus_per_pod=8, gpu_models=(MODEL,), max_runtime_s=12 * HOUR,
                     checkpoint_interval_s=interval) for i in range(2)]
    jobs.append(TraceJob(job_id="b-0", submit_time=b_submits_at, duration=HOUR, team="team-b", queue="team-b",
                         pods=1, gpus_per_pod=8, gpu_models=(MODEL,), max_runtime_s=2 * HOUR))
    return Trace(name="guarantee", jobs=jobs, nodes=nodes, queues=queues)


def _b_wait(trace: Trace) -> float:
    result = Engine(trace=trace, policy=make_policy("gpuq")).run()
    b = result.records["b-0"]
    assert b.start is not None, "team B never got its nominal quota"
    return b.start - b.job.submit_time


@pytest.mark.parametrize("max_loss", [1800, 0, None])
def test_b_gets_its_nominal_quota_even_when_no_borrower_can_checkpoint(max_loss: int | None) -> None:
    # A's jobs have run 5,000 s without a checkpoint: far past any unsaved-work bound
    assert _b_wait(_trace(5000, window=600, max_loss=max_loss)) <= 300 + 600


def test_young_borrowers_are_protected_then_reclaimed() -> None:
    # B arrives 100 s after A's jobs started: they are protected for the rest of the 600 s window, then reclaimed
    wait = _b_wait(_trace(100, window=600, max_loss=1800))
    assert 600 - 100 <= wait <= 300 + 600


def test_a_queue_can_refuse_risky_borrowing_up_front() -> None:
    # team-a lets its jobs that cannot checkpoint borrow only if they are limited to an hour: the second 8-GPU
    # job (12 h limit, no checkpoint) waits instead of borrowing, so B starts at once and nothing is preempted
    trace = _trace(5000, window=600, max_loss=1800, extra={"max_borrow_runtime_without_checkpoint_s": HOUR})
    result = Engine(trace=trace, policy=make_policy("gpuq")).run()
    assert result.records["b-0"].start == 5000
    assert sum(r.preemptions for r in result.records.values()) == 0
    # a checkpointing job is not held back by that limit
    trace = _trace(5000, window=600, max_loss=1800, a_checkpoints=True,
                   extra={"max_borrow_runtime_without_checkpoint_s": HOUR})
    result = Engine(trace=trace, policy=make_policy("gpuq")).run()
    assert {r.job.job_id for r in result.records.values() if r.start == 0} == {"a-0", "a-1"}


def test_a_high_priority_job_preempts_its_own_queues_low_priority_job_when_the_queue_is_at_its_quota() -> None:
    queues = parse_queues({
        "priority_classes": [{"name": "low", "value": 0, "preemptible": True},
                             {"name": "normal", "value": 100, "preemptible": True}],
        "queues": [{"name": "team-a", "quotas": {MODEL: {"nominal": 8}}}],  # within_queue: LowerPriority
        "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300},
    })
    nodes = [NodeSpec(name=f"n-{i}", gpus=8, gpu_model=MODEL, cpu_milli=96000, memory_mib=1 << 20,
                      rack="r-0", block="b-0") for i in range(2)]  # 8 GPUs stay free: only the quota is full
    jobs = [TraceJob(job_id=f"low-{i}", submit_time=0, duration=10 * HOUR, team="team-a", queue="team-a",
                     pods=1, gpus_per_pod=4, gpu_models=(MODEL,), priority_class="low",
                     max_runtime_s=12 * HOUR, checkpoint_interval_s=600) for i in range(2)]
    jobs.append(TraceJob(job_id="boss", submit_time=5000, duration=HOUR, team="team-a", queue="team-a", pods=1,
                         gpus_per_pod=4, gpu_models=(MODEL,), priority_class="normal", max_runtime_s=2 * HOUR))
    result = Engine(trace=Trace(name="within", jobs=jobs, nodes=nodes, queues=queues),
                    policy=make_policy("gpuq")).run()
    assert result.records["boss"].start == 5000
    assert sorted(r.preemptions for r in result.records.values()) == [0, 0, 1]
