"""Node failures in a replay: seeded generation, and what a failure does to running jobs under every policy."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from sim.engine import Engine
from sim.failures import NodeFailure, lost_work_s, synth_node_failures
from sim.metrics import compute_metrics
from sim.run import make_policy

from .conftest import job, nodes, trace

ALL = ("gpuq", "gpuq-nopreempt", "quota-fifo", "pod-fifo")


def test_generated_failures_are_seeded_sorted_and_never_overlap_on_a_node() -> None:
    ns = nodes(20)
    a = synth_node_failures(ns, 30 * 86_400, mtbf_h=100, repair_h=2, seed=7)
    assert a == synth_node_failures(ns, 30 * 86_400, mtbf_h=100, repair_h=2, seed=7)
    assert a != synth_node_failures(ns, 30 * 86_400, mtbf_h=100, repair_h=2, seed=8)
    assert a == sorted(a) and 20 < len(a) < 300  # 20 nodes × 720 h / 100 h ≈ 144 expected
    for f in a:
        assert 0 <= f.down_at < 30 * 86_400 and f.up_at >= f.down_at + 60
    for name in {f.node for f in a}:
        mine = [f for f in a if f.node == name]
        assert all(x.up_at <= y.down_at for x, y in itertools.pairwise(mine))
    # a node's failures do not depend on the other nodes
    assert [f for f in a if f.node == ns[0].name] == \
        [f for f in synth_node_failures(ns[:1], 30 * 86_400, 100, 2, seed=7)]
    with pytest.raises(ValueError, match="node-mtbf-h"):
        synth_node_failures(ns, 100, mtbf_h=0, repair_h=1, seed=0)


def test_lost_work_is_what_ran_since_the_last_checkpoint() -> None:
    assert lost_work_s(250, None) == 250
    assert lost_work_s(250, 100) == 50
    assert lost_work_s(200, 100) == 0


@pytest.mark.parametrize("name", ALL)
def test_a_failure_stops_the_job_which_resumes_elsewhere_from_its_checkpoint(name: str) -> None:
    # Two 8-GPU nodes. A (8 GPUs, 1,000 s, checkpoints every 100 s) starts at 0 on the first node, which
    # fails at 250 for 1,000 s. A loses the 50 s since its checkpoint at 200, restarts at once on the other
    # node with 800 s left, and ends at 1,050. B (8 GPUs) arrives at 300 and must wait for A: the failed node
    # takes nothing until it comes back at 1,250.
    tr = trace([replace(job("a", 0, 1000, gpus_per_pod=8), checkpoint_interval_s=100),
                job("b", 300, 100, gpus_per_pod=8)], node_count=2)
    first = tr.nodes[0].name
    res = Engine(tr, make_policy(name), failures=[NodeFailure(down_at=250, node=first, up_at=1250)]).run()
    a, b = res.records["a"], res.records["b"]
    assert a.node_failures == 1 and a.start == 0 and a.end == 1050
    assert a.failure_lost_gpu_s == pytest.approx(8 * 50)
    assert b.start == 1050 and b.end == 1150
    m = compute_metrics(res, sim_wall_s=1.0)
    assert m["node_failures"] == 1 and m["jobs_stopped_by_node_failures"] == 1
    assert m["failure_lost_gpu_hours"] == pytest.approx(8 * 50 / 3600, abs=1e-3)
    assert m["makespan_s"] == 1150  # the node's repair after the last job does not stretch the replay


@pytest.mark.parametrize("name", ALL)
def test_without_checkpoints_a_failure_loses_everything_and_the_job_waits_for_the_node(name: str) -> None:
    # One node: A (no checkpoints) has run 300 s of 500 when the node fails for 200 s; it starts over at 500.
    tr = trace([job("a", 0, 500, gpus_per_pod=8)])
    res = Engine(tr, make_policy(name), failures=[NodeFailure(down_at=300, node=tr.nodes[0].name, up_at=500)]).run()
    a = res.records["a"]
    assert a.node_failures == 1 and a.failure_lost_gpu_s == pytest.approx(8 * 300)
    assert a.end == 1000
