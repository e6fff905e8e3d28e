"""The simulator's `gpuq` policy runs the shared decision loop, so a queue's `pools` choose each job's node pool
there as in the services (docs/admission.md, "Node pools as flavors"): the job is placed on its pool's nodes."""

from __future__ import annotations

from shared.config import FlavorQuota
from sim.policies.gpuq import GpuqPolicy
from sim.run import make_policy

from .conftest import job, trace


def test_the_replay_places_each_job_on_the_pool_admission_chose() -> None:
    tr = trace([job(f"j{i}", i, 1000, gpus_per_pod=4) for i in range(3)], node_count=2)
    tr.nodes = [n.model_copy(update={"labels": {**n.labels, "pool": p}}) for n, p in zip(tr.nodes, ("a", "b"),
                                                                                        strict=True)]
    q = tr.queues.queue_map["a"]
    q = q.model_copy(update={"pools": ("a", "b"), "quotas": {**q.quotas, "pool/a": FlavorQuota(nominal=4),
                                                             "pool/b": FlavorQuota(nominal=8)}})
    tr.queues = tr.queues.model_copy(update={"queues": (q,)})
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
    pool_of = {n.name: n.labels["pool"] for n in tr.nodes}
    # j0 takes pool a's quota (4); binpack alone would put j1 next to it on pool a's node
    assert [pool_of[where[f"j{i}"]] for i in range(3)] == ["a", "b", "b"]
