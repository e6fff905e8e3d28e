"""Work lost to preemption is reported per cause (reclaim, priority, node failure) and as a share of delivery."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.engine import Engine, loss_cause
from sim.failures import NodeFailure
from sim.metrics import compute_metrics
from sim.run import make_policy

from .conftest import job, trace


def test_reasons_map_to_causes() -> None:
    assert loss_cause("ReclaimQuota") == "reclaim"
    assert loss_cause("PriorityPreemption") == "priority"
    assert loss_cause("DefragmentationMove") == "defragmentation"
    assert loss_cause("SomethingElse") == "other"


@pytest.mark.parametrize("name", ["gpuq-evict", "kueue"])
def test_a_reclaim_of_lent_quota_is_counted_as_reclaim(name: str) -> None:
    # One 8-GPU node, teams a and b with 4 GPUs each in one cohort. A (team a, low, 8 GPUs, no checkpoints) borrows
    # b's half at 0; b's job arrives at 2,000 and takes its quota back: A loses its 2,000 s on 8 GPUs.
    tr = trace([job("a1", 0, 5000, gpus_per_pod=8, team="a", priority="low"),
                job("b1", 2000, 100, gpus_per_pod=4, team="b")], teams=["a", "b"])
    res = Engine(tr, make_policy(name)).run()
    m = compute_metrics(res, sim_wall_s=1.0)
    causes = m["lost_gpu_hours_by_cause"]
    assert causes["reclaim"] == pytest.approx(8 * 2000 / 3600, abs=1e-3)
    assert causes["priority"] == causes["node_failure"] == causes["other"] == 0
    assert sum(causes.values()) == pytest.approx(m["lost_gpu_hours"], abs=2e-3)
    assert m["lost_work_share"] == pytest.approx(causes["reclaim"] / m["delivered_gpu_hours"], abs=1e-4)


@pytest.mark.parametrize("name", ["gpuq-evict", "kueue"])
def test_a_higher_priority_job_of_the_same_queue_is_counted_as_priority(name: str) -> None:
    # LOW checkpoints every 1,500 s (an unsaved day of work would protect it from a priority preemption): the
    # high job at 2,000 takes its node, and LOW loses the 500 s since its checkpoint at 1,500.
    low = replace(job("low", 0, 5000, gpus_per_pod=8, priority="low"), checkpoint_interval_s=1500)
    tr = trace([low, job("high", 2000, 100, gpus_per_pod=8, priority="high")])
    m = compute_metrics(Engine(tr, make_policy(name)).run(), sim_wall_s=1.0)
    causes = m["lost_gpu_hours_by_cause"]
    assert causes["priority"] == pytest.approx(8 * 500 / 3600, abs=1e-3)
    assert causes["reclaim"] == causes["node_failure"] == 0


def test_node_failures_are_their_own_cause() -> None:
    tr = trace([job("a", 0, 500, gpus_per_pod=8)])
    res = Engine(tr, make_policy("gpuq"), failures=[NodeFailure(down_at=300, node=tr.nodes[0].name, up_at=500)]).run()
    m = compute_metrics(res, sim_wall_s=1.0)
    assert m["lost_gpu_hours_by_cause"]["node_failure"] == pytest.approx(8 * 300 / 3600, abs=1e-3)
    assert m["lost_gpu_hours_by_cause"]["reclaim"] == m["lost_gpu_hours_by_cause"]["priority"] == 0
