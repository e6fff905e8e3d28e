"""No starvation (services/core/admission/starvation.py), on an adversarial workload replayed by the simulator on
the production cores: a gang that does not fit its queue's free quota while a stream of small jobs of the same
queue keeps taking every GPU that frees. With the rule (on by default) the gang waits at most the bound
max(K × its class's median wait, starvation_min_wait_s) plus the time its queue's running jobs take to give back
what it asks (their limit); with the rule off (the mutant) it waits until the stream stops."""

from __future__ import annotations

from typing import Any

import pytest

from shared.config import parse_queues
from shared.domain import NodeSpec
from sim.engine import Engine
from sim.model import Trace, TraceJob
from sim.run import make_policy

MODEL = "H100-80GB"
SMALL_S = 1000  # each small job runs 1,000 s (its limit too)
STREAM_END = 40_000  # small jobs keep arriving until then
FLOOR = 600


def _trace(policy: dict[str, Any], *, seed: int) -> Trace:
    queues = parse_queues({
        "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
        "queues": [{"name": "team-a", "quotas": {MODEL: {"nominal": 16}}}],
        "policy": policy,
    })
    nodes = [NodeSpec(name=f"n-{i}", gpus=8, gpu_model=MODEL, cpu_milli=96000, memory_mib=1 << 20,
                      rack="r-0", block="b-0") for i in range(2)]
    jobs: list[TraceJob] = []
    # small 1-GPU jobs, one every 1000/16.5 s on average (a seeded jitter): a little more than the 16 GPUs serve,
    # so their ends are spread and a freed GPU always finds a small job waiting
    t, i = 0.0, 0
    step = SMALL_S / 16.5
    while t < STREAM_END:
        jobs.append(TraceJob(job_id=f"s-{i:05d}", submit_time=int(t), duration=SMALL_S, team="team-a",
                             queue="team-a", pods=1, gpus_per_pod=1, gpu_models=(MODEL,), max_runtime_s=SMALL_S))
        i += 1
        t += step * (0.5 + ((i * 7919 + seed * 104729) % 1000) / 1000)
    # the gang: 8 one-GPU pods, needs 8 of the queue's 16 GPUs of quota at once
    jobs.append(TraceJob(job_id="gang", submit_time=3000, duration=500, team="team-a", queue="team-a", pods=8,
                         gpus_per_pod=1, gpu_models=(MODEL,), max_runtime_s=500))
    jobs.sort(key=lambda j: (j.submit_time, j.job_id))
    return Trace(name="starvation", jobs=jobs, nodes=nodes, queues=queues)


def _waits(policy: dict[str, Any], seed: int) -> tuple[float, list[float]]:
    result = Engine(trace=_trace(policy, seed=seed), policy=make_policy("gpuq")).run()
    gang = result.records["gang"]
    assert gang.start is not None
    small = [r.start - r.job.submit_time for j, r in result.records.items() if j != "gang" and r.start is not None]
    return gang.start - gang.job.submit_time, small


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_gang_waits_no_longer_than_the_bound_with_the_rule_and_starves_without(seed: int) -> None:
    factor = 10.0
    wait, small = _waits({"starvation_factor": factor, "starvation_min_wait_s": FLOOR}, seed)
    small.sort()
    median = small[len(small) // 2]
    bound = max(factor * median, FLOOR) + SMALL_S  # the threshold, then the queue's running jobs give back
    assert wait <= bound, (wait, bound, median)
    # the mutant: the rule off, the gang waits for the stream to stop
    off, _ = _waits({"starvation_factor": None}, seed)
    assert off > STREAM_END / 2 > bound


def test_the_rule_is_on_by_default_with_a_stated_bound() -> None:
    from shared.config import Policy

    assert Policy().starvation_factor == 10.0 and Policy().starvation_min_wait_s == 3600
