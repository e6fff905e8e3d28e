"""A synthetic, Philly-shaped workload for the demo (the demo never ships real traces).

Shape from the published facts about Philly (shared traces README): most jobs take 1 GPU, a few percent
are multi-GPU and hold most GPU-hours, a fraction of a percent are multi-node gangs; durations are heavy
tailed (median ~20 min, p90 ~3 h). Arrivals are Poisson, sized so that the offered load on the given
capacity is `load`. Seeded: the same arguments give the same jobs.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from shared.domain import CheckpointSpec, JobSpec, PodSet, TopologyLevel, TopologyRequest

# (gpus, weight): 1-GPU dominates, then 2/4/8, then rare multi-node gangs.
GANG_MIX: tuple[tuple[int, float], ...] = ((1, 0.80), (2, 0.06), (4, 0.06), (8, 0.05), (16, 0.02), (32, 0.01))
DURATION_MEDIAN_S = 1_200.0
DURATION_SIGMA = 1.6  # lognormal: p90 ≈ median × e^(1.28σ) ≈ 7.8 × median
RUNTIME_BUCKETS_S = (900, 1_800, 3_600, 7_200, 14_400, 28_800, 57_600, 86_400)


@dataclass(frozen=True)
class SyntheticJob:
    spec: JobSpec
    submit_offset_s: float  # from the start of the workload
    duration_s: float  # the truth, seen only by the simulated executor (label sim.gpuq.io/duration-s)


def _bucket(seconds: float) -> int:
    for b in RUNTIME_BUCKETS_S:
        if seconds <= b:
            return b
    return RUNTIME_BUCKETS_S[-1]


def generate(*, teams: list[str], jobs: int, capacity_gpus: int, load: float = 0.9, seed: int = 7,
             gpu_model: str | None = None, gpus_per_node: int = 8, max_duration_s: float = 4 * 3_600.0,
             priority_mix: tuple[tuple[str, float], ...] = (("high", 0.05), ("normal", 0.75), ("low", 0.20)),
             ) -> list[SyntheticJob]:
    if not teams:
        raise ValueError("at least one team is needed")
    rng = random.Random(seed)
    drafts: list[tuple[int, float, str, str]] = []
    sizes, weights = zip(*GANG_MIX, strict=True)
    for _ in range(jobs):
        gpus = min(rng.choices(sizes, weights)[0], capacity_gpus)
        duration = min(max_duration_s, max(60.0, rng.lognormvariate(math.log(DURATION_MEDIAN_S), DURATION_SIGMA)))
        team = teams[min(len(teams) - 1, int(rng.paretovariate(1.2)) - 1)]  # a few teams submit most jobs
        r, acc, klass = rng.random(), 0.0, priority_mix[-1][0]
        for name, share in priority_mix:
            acc += share
            if r < acc:
                klass = name
                break
        drafts.append((gpus, duration, team, klass))
    offered_gpu_s = sum(g * d for g, d, _, _ in drafts)
    span = offered_gpu_s / (capacity_gpus * load)
    rate = jobs / span
    t = 0.0
    out: list[SyntheticJob] = []
    for i, (gpus, duration, team, klass) in enumerate(drafts):
        t += rng.expovariate(rate)
        per_pod = min(gpus, gpus_per_node)
        pods = max(1, gpus // per_pod)
        estimate = _bucket(duration * rng.lognormvariate(0.4, 0.5))
        spec = JobSpec(
            job_id=f"demo-{i:05d}", team=team, queue=team, priority_class=klass,
            pod_sets=(PodSet(count=pods, gpus_per_pod=per_pod, gpu_models=(gpu_model,) if gpu_model else ()),),
            topology=TopologyRequest(preferred_level=TopologyLevel.RACK) if pods > 1 else TopologyRequest(),
            checkpoint=CheckpointSpec(supported=rng.random() < 0.8, interval_s=1_800),
            max_runtime_s=max(estimate, int(duration) + 1) if rng.random() < 0.9 else estimate,
            labels={"sim.gpuq.io/duration-s": f"{duration:.0f}",
                    "sim.gpuq.io/utilization": f"{rng.choice((35, 60, 75, 85, 95))}",
                    "feature": rng.choice(("pretraining", "finetuning", "eval", "rl")),
                    "project": f"proj-{rng.randint(1, 6)}"},
        )
        out.append(SyntheticJob(spec=spec, submit_offset_s=t, duration_s=duration))
    return out
