"""The decision loop (what the simulator and the ETA run) reclaims borrowed CPU as the preemption service does
(issue 48 item 5): a running job's usage carries what admission charged besides GPUs, and a preemptor short only of
CPU keeps its own GPU models."""

from __future__ import annotations

from services.core.preemption import RECLAIM
from shared.config import parse_queues
from shared.domain import JobSpec, PodSet
from tests.unit.pipeline.test_decision_loop import Loop
from tests.unit.preemption.builders import MODEL

CONFIG = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [{"name": q, "cohort": "research", "quotas": {MODEL: {"nominal": 8}, "cpu_milli": {"nominal": 4000}}}
               for q in ("team-a", "team-b")],
    "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300, "max_victim_loss_s": None},
})


def spec(job_id: str, queue: str, klass: str = "low") -> JobSpec:
    """1 GPU and 3 CPUs."""
    return JobSpec(job_id=job_id, team=queue, queue=queue, priority_class=klass, max_runtime_s=36_000,
                   pod_sets=(PodSet(count=1, gpus_per_pod=1, gpu_models=(MODEL,), cpu_milli=3000, memory_mib=0),))


def test_a_cpu_reclaim_takes_the_newest_cpu_borrower_in_the_same_pass() -> None:
    loop = Loop(CONFIG, node_count=1)
    for i, at in enumerate((0.0, 1000.0)):  # team-b: 6 CPUs on a nominal 4, 2 of its 8 GPUs
        loop.submit(spec(f"b{i}", "team-b"), at)
        loop.decide(at)
    assert set(loop.believed) == {"b0", "b1"}
    loop.submit(spec("a", "team-a", "normal"), 5000.0)  # team-a's GPU fits; 2 of its 4 CPUs are lent
    d = loop.decide(5000.0)
    assert [(p.job_id, p.preemptor, p.reason) for p in d.preemptions] == [("b1", "a", RECLAIM)]
