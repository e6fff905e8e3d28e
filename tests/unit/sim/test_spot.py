"""Spot interruptions in a replay (sim/failures.py): which nodes are spot, and what a notice saves."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.engine import Engine
from sim.failures import NodeFailure, lost_work_s, spot_nodes, synth_spot_interruptions
from sim.run import make_policy

from .conftest import job, nodes, trace


def test_spot_nodes_are_the_labelled_ones_else_a_seeded_share() -> None:
    ns = nodes(40)
    half = spot_nodes(ns, 0.5, seed=3)
    assert half == spot_nodes(ns, 0.5, seed=3) and 8 < len(half) < 32
    assert spot_nodes(ns, 0.0, seed=3) == [] and len(spot_nodes(ns, 1.0, seed=3)) == 40
    labelled = [ns[5].model_copy(update={"labels": {**ns[5].labels, "gpuq.io/spot": "true"}}), *ns[6:]]
    assert [n.name for n in spot_nodes(labelled, 0.5, seed=3)] == [ns[5].name]
    with pytest.raises(ValueError, match="spot-share"):
        spot_nodes(ns, 1.5, seed=0)


def test_interruptions_carry_their_notice() -> None:
    out = synth_spot_interruptions(nodes(10), 30 * 86_400, mtbi_h=24, replace_h=0.25, notice_s=120, checkpoint_s=60,
                                   seed=1)
    assert out and all(f.notice_s == 120 and f.checkpoint_s == 60 for f in out)
    assert out == sorted(out)


def test_a_notice_saves_the_work_of_a_job_that_can_checkpoint_in_time() -> None:
    notice = NodeFailure(0, "n", 1, notice_s=120, checkpoint_s=60)
    assert lost_work_s(250, 100, notice) == 0  # it checkpointed on the notice
    assert lost_work_s(250, None, notice) == 250  # it cannot checkpoint: all lost, notice or not
    assert lost_work_s(250, 100, replace(notice, checkpoint_s=300)) == 50  # its write does not fit the notice
    assert lost_work_s(250, 100, replace(notice, notice_s=0)) == 50  # no notice: since its last checkpoint


@pytest.mark.parametrize("notice_s,lost", [(0, 8 * 50), (120, 0)])
def test_an_interrupted_job_resumes_from_the_checkpoint_its_notice_gave(notice_s: int, lost: int) -> None:
    # Two 8-GPU nodes. A (checkpoints every 100 s) runs on the first, interrupted at 250: without notice it loses the
    # 50 s since its checkpoint at 200 and ends at 1,050; with 120 s of notice it checkpoints then and ends at 1,000.
    tr = trace([replace(job("a", 0, 1000, gpus_per_pod=8), checkpoint_interval_s=100)], node_count=2)
    spot = NodeFailure(down_at=250, node=tr.nodes[0].name, up_at=1250, notice_s=notice_s, checkpoint_s=60)
    res = Engine(tr, make_policy("gpuq"), failures=[spot]).run()
    a = res.records["a"]
    assert a.node_failures == 1 and a.failure_lost_gpu_s == pytest.approx(lost)
    assert a.end == 1000 + lost / 8
