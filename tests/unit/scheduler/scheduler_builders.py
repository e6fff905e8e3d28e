"""Builders for placement-core tests: clusters and jobs in one line each."""

from __future__ import annotations

from shared.domain import (
    JobSpec,
    MigLayout,
    NodeHealth,
    NodeSpec,
    PodSet,
    Taint,
    TaintEffect,
    Toleration,
    TopologyLevel,
    TopologyRequest,
)


def nodes(count: int, *, prefix: str = "n", gpus: int = 8, model: str = "H100-80GB", per_rack: int = 4,
          racks_per_block: int = 4, cpu: int = 96_000, mem: int = 1_048_576, mig: MigLayout | None = None,
          taints: tuple[Taint, ...] = (), labels: dict[str, str] | None = None,
          datasets: tuple[str, ...] = (), health: NodeHealth = NodeHealth.READY) -> list[NodeSpec]:
    out = []
    for i in range(count):
        rack = i // per_rack
        out.append(NodeSpec(name=f"{prefix}-{i}", gpus=gpus, gpu_model=model, cpu_milli=cpu, memory_mib=mem,
                            mig=mig, taints=taints, labels=labels or {}, datasets=datasets, health=health,
                            rack=f"{prefix}-rack{rack}", block=f"{prefix}-block{rack // racks_per_block}"))
    return out


def job(job_id: str, *, pods: int = 1, gpus: int = 1, models: tuple[str, ...] = (), mig: str | None = None,
        cpu: int = 1000, mem: int = 4096, required: str | None = None, preferred: str | None = None,
        tolerations: tuple[Toleration, ...] = (), datasets: tuple[str, ...] = (), min_members: int | None = None,
        runtime: int = 3600, kind: str = "training", pod_sets: tuple[PodSet, ...] | None = None) -> JobSpec:
    topo = TopologyRequest(required_level=TopologyLevel(required) if required else None,
                           preferred_level=TopologyLevel(preferred) if preferred else None)
    sets = pod_sets or (PodSet(name="worker", count=pods, gpus_per_pod=1 if mig else gpus, gpu_models=models,
                               mig_profile=mig, cpu_milli=cpu, memory_mib=mem),)
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", kind=kind, pod_sets=sets, topology=topo,
                   tolerations=tolerations, datasets=datasets, min_members=min_members, max_runtime_s=runtime)


INFERENCE_TAINT = Taint(key="pool", value="inference", effect=TaintEffect.NO_SCHEDULE)
TOLERATE_INFERENCE = Toleration(key="pool", value="inference", effect=TaintEffect.NO_SCHEDULE)
