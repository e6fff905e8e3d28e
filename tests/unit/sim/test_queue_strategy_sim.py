"""The simulator's `gpuq` policies place each queue's jobs with its queues.yaml `placement_strategy`."""

from __future__ import annotations

from sim.policies.gpuq import GpuqPolicy
from sim.run import make_policy

from .conftest import job, trace


def test_a_spread_queue_is_placed_spread_in_the_replay() -> None:
    tr = trace([job("a1", 0, 1000, gpus_per_pod=4, team="a"), job("w1", 10, 1000, gpus_per_pod=1, team="wide"),
                job("a2", 20, 1000, gpus_per_pod=1, team="a")], node_count=2, teams=["a", "wide"])
    wide = tr.queues.queue_map["wide"].model_copy(update={"placement_strategy": "spread"})
    tr.queues = tr.queues.model_copy(update={"queues": (tr.queues.queue_map["a"], wide)})
    policy = make_policy("gpuq")
    assert isinstance(policy, GpuqPolicy)
    policy.setup(tr)
    where = {}
    for j in tr.jobs:
        assert policy.on_arrival(j, j.submit_time) is None
        policy.cycle(j.submit_time)
        placement = policy.cluster.placement_of(j.job_id)
        assert placement is not None
        where[j.job_id] = placement.bindings[0].node
    assert where["w1"] != where["a1"]  # spread: the empty node
    assert where["a2"] == where["a1"]  # binpack: the fuller node
