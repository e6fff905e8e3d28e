"""Builders for telemetry tests: nodes, specs, and the events of a job's life, at times relative to T0."""

from __future__ import annotations

from datetime import UTC, datetime

from shared.domain import CheckpointSpec, GpuBinding, JobSpec, NodeHealth, NodeSpec, PodSet, Taint
from shared.events import (
    ExitReason,
    GpuSample,
    JobAdmitted,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobPending,
    JobPlaced,
    JobPreempted,
    JobStarted,
    JobSubmitted,
    NodeInventory,
    Payload,
    PreemptionReason,
    UtilizationSampled,
)

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def at(t: float) -> datetime:
    return datetime.fromtimestamp(T0 + t, tz=UTC)


def node(name: str, gpus: int = 8, model: str = "H100", pool: str = "training",
         health: NodeHealth = NodeHealth.READY, taints: tuple[Taint, ...] = ()) -> NodeSpec:
    return NodeSpec(name=name, gpus=gpus, gpu_model=model, cpu_milli=96000, memory_mib=1 << 20,
                    labels={"pool": pool}, rack=f"{name}-rack", block="b0", health=health, taints=taints)


def spec(job_id: str, team: str = "team-a", queue: str | None = None, pods: int = 1, gpus_per_pod: int = 1,
         priority: str = "normal", feature: str = "llm", checkpoint: bool = True,
         models: tuple[str, ...] = ()) -> JobSpec:
    return JobSpec(job_id=job_id, team=team, queue=queue or team, priority_class=priority,
                   pod_sets=(PodSet(count=pods, gpus_per_pod=gpus_per_pod, gpu_models=models),),
                   labels={"feature": feature}, checkpoint=CheckpointSpec(supported=checkpoint, interval_s=600))


def bindings(s: JobSpec, placement: dict[str, list[int]]) -> tuple[GpuBinding, ...]:
    """One binding per node, GPUs as given (tests keep pods and nodes one to one)."""
    return tuple(GpuBinding(pod=f"main-{i}", node=n, gpu_indices=tuple(g))
                 for i, (n, g) in enumerate(sorted(placement.items())))


def life(s: JobSpec, placement: dict[str, list[int]], t_submit: float, wait: float, run: float,
         util: float = 80.0, end: ExitReason | None = ExitReason.SUCCEEDED) -> list[tuple[float, Payload]]:
    """(time, payload) pairs for submit → pending → admitted → placed → started → a sample → end."""
    ta = t_submit + wait
    events: list[tuple[float, Payload]] = [
        (t_submit, JobSubmitted(spec=s, submitted_at=at(t_submit))),
        (t_submit + 1, JobPending(job_id=s.job_id, queue=s.queue, reason="QuotaExhausted",
                                  message="waiting for quota", position_in_queue=1, eta=at(ta))),
        (ta, JobAdmitted(job_id=s.job_id, spec=s, admitted_at=at(ta))),
        (ta + 1, JobPlaced(job_id=s.job_id, spec=s, bindings=bindings(s, placement), placed_at=at(ta + 1))),
        (ta + 2, JobStarted(job_id=s.job_id, started_at=at(ta + 2))),
    ]
    for n, gpus in sorted(placement.items()):
        events.append((ta + 30, sample(n, {g: (s.job_id, util) for g in gpus}, ta + 30)))
    if end is ExitReason.SUCCEEDED:
        events.append((ta + run, JobCompleted(job_id=s.job_id, finished_at=at(ta + run))))
    elif end is not None:
        events.append((ta + run, JobFailed(job_id=s.job_id, exit_reason=end, finished_at=at(ta + run))))
    return events


def sample(n: str, gpus: dict[int, tuple[str | None, float]], t: float, interval: float = 30.0,
           model: str | None = "H100") -> UtilizationSampled:
    return UtilizationSampled(node=n, gpu_model=model, sampled_at=at(t), interval_s=interval,
                              samples=tuple(GpuSample(job_id=j, gpu_index=g, utilization_pct=u,
                                                      memory_used_mib=40_000 if j else 0)
                                            for g, (j, u) in sorted(gpus.items())))


def inventory(*nodes: NodeSpec) -> NodeInventory:
    return NodeInventory(nodes=tuple(nodes))


def checkpointed(job_id: str, t: float) -> JobCheckpointed:
    return JobCheckpointed(job_id=job_id, uri=f"s3://ckpt/{job_id}", checkpointed_at=at(t))


def preempted(job_id: str, t: float, lost: float = 120.0,
              reason: PreemptionReason = PreemptionReason.RECLAIM) -> JobPreempted:
    return JobPreempted(job_id=job_id, reason=reason, lost_gpu_seconds=lost, preempted_at=at(t))
