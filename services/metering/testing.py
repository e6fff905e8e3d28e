"""Builders for metering test data and the benchmark: times in seconds from a fixed Monday 09:00 UTC."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from shared.domain import GpuBinding, JobSpec, PodSet
from shared.events import GpuSample, JobPlaced, UtilizationSampled

T0 = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)
T0_MS = 1_736_154_000_000


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ms(seconds: float) -> int:
    return T0_MS + round(seconds * 1000)


def spec(job_id: str, *, team: str = "team-a", queue: str | None = None, gpus: int = 8, pods: int = 1,
         model: str | None = "H100-80GB", priority_class: str = "normal", labels: dict[str, str] | None = None,
         mig_profile: str | None = None) -> JobSpec:
    pod_set = PodSet(count=pods, gpus_per_pod=1 if mig_profile else gpus // pods,
                     gpu_models=(model,) if model else (), mig_profile=mig_profile)
    return JobSpec(job_id=job_id, team=team, queue=queue or team, priority_class=priority_class,
                   pod_sets=(pod_set,), labels=labels or {})


def placed(job: JobSpec, seconds: float, nodes: list[str], gpus_per_node: int = 8) -> JobPlaced:
    bindings = tuple(GpuBinding(pod=f"main-{i}", node=node, gpu_indices=tuple(range(gpus_per_node)))
                     for i, node in enumerate(nodes))
    return JobPlaced(job_id=job.job_id, spec=job, bindings=bindings, placed_at=at(seconds))


def sampled(node: str, seconds: float, job_id: str | None, utils: list[float], *, power: float = 400.0,
            interval_s: float = 60.0, model: str | None = "H100-80GB") -> UtilizationSampled:
    return UtilizationSampled(
        node=node, gpu_model=model, sampled_at=at(seconds), interval_s=interval_s,
        samples=tuple(GpuSample(job_id=job_id, gpu_index=i, utilization_pct=u, power_w=power)
                      for i, u in enumerate(utils)))
