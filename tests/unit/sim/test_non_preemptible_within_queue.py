"""A job that may not borrow (here: non-preemptible) waits for room within its queue's nominal quota. When its
queue's own lower-priority jobs hold that quota and more (one of them borrowing from the cohort), the within-queue
preemption must free everything the queue uses beyond nominal - request, not only what the cohort lacks: before,
one borrower was preempted, borrowed the freed room back, and the high-priority job waited until its queue's jobs
ended (two days here; on Philly October the high class's p99 wait was 445,091 s)."""

from __future__ import annotations

from shared.config import parse_queues
from shared.domain import NodeSpec
from sim.engine import Engine
from sim.model import Trace, TraceJob
from sim.run import make_policy

MODEL = "H100-80GB"
HOUR = 3600


def test_a_non_preemptible_job_gets_its_queues_nominal_quota_from_its_own_borrowing_jobs() -> None:
    queues = parse_queues({
        "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                             {"name": "normal", "value": 100, "preemptible": True}],
        "cohorts": [{"name": "c"}],
        "queues": [{"name": "a", "cohort": "c", "quotas": {MODEL: {"nominal": 8}}},
                   {"name": "b", "cohort": "c", "quotas": {MODEL: {"nominal": 8}}}],
        "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300},
    })
    nodes = [NodeSpec(name=f"n-{i}", gpus=8, gpu_model=MODEL, cpu_milli=96000, memory_mib=1 << 20, rack="r-0",
                      block="b-0") for i in range(2)]
    # queue a runs two 8-GPU normal jobs for two days: one within its nominal 8, one borrowing b's idle 8
    jobs = [TraceJob(job_id=f"a-{i}", submit_time=0, duration=48 * HOUR, team="a", queue="a", pods=1, gpus_per_pod=8,
                     gpu_models=(MODEL,), max_runtime_s=72 * HOUR, checkpoint_interval_s=1800) for i in range(2)]
    jobs.append(TraceJob(job_id="hi", submit_time=2 * HOUR, duration=HOUR, team="a", queue="a", pods=1,
                         gpus_per_pod=8, gpu_models=(MODEL,), priority_class="high", max_runtime_s=2 * HOUR))
    result = Engine(trace=Trace(name="within", jobs=jobs, nodes=nodes, queues=queues),
                    policy=make_policy("gpuq")).run()
    hi = result.records["hi"]
    assert hi.start is not None and hi.start - hi.job.submit_time <= 600 + 300  # protection window + grace at most
    assert sorted(r.preemptions for j, r in result.records.items() if j != "hi") == [1, 1]
