"""Builders for admission-core tests: small configs and jobs in one line each."""

from __future__ import annotations

from typing import Any

from services.core.admission import AdmissionState, AdmittedWorkload, Workload
from shared.config import QueuesConfig, parse_queues
from shared.domain import JobSpec, PodSet

H100 = "H100-80GB"
A100 = "A100-80GB"

CLASSES = [
    {"name": "production", "value": 1000, "preemptible": False},
    {"name": "high", "value": 500, "preemptible": False},
    {"name": "normal", "value": 100, "preemptible": True},
    {"name": "low", "value": 0, "preemptible": True},
]


def quota(nominal: int, borrowing_limit: int | None = None, lending_limit: int | None = None) -> dict[str, Any]:
    return {"nominal": nominal, "borrowing_limit": borrowing_limit, "lending_limit": lending_limit}


def queue(name: str, quotas: dict[str, Any] | None = None, *, cohort: str | None = "research",
          teams: tuple[str, ...] = (), weight: float = 1, strategy: str = "BestEffortFIFO",
          max_running_jobs: int | None = None, reclaim: str = "LowerPriority") -> dict[str, Any]:
    """`quotas` values may be an int (nominal only) or a `quota(...)` dict."""
    qs = {m: (quota(v) if isinstance(v, int) else v) for m, v in (quotas or {H100: 8}).items()}
    return {"name": name, "cohort": cohort, "teams": list(teams), "weight": weight, "quotas": qs,
            "queueing_strategy": strategy, "max_running_jobs": max_running_jobs,
            "preemption": {"within_queue": "LowerPriority", "reclaim_within_cohort": reclaim}}


def config(*queues: dict[str, Any], cohorts: tuple[str, ...] = ("research",),
           flavors: dict[str, float] | None = None, policy: dict[str, Any] | None = None) -> QueuesConfig:
    return parse_queues({
        "priority_classes": CLASSES,
        "cohorts": [{"name": c} for c in cohorts],
        "queues": list(queues),
        "gpu_flavors": {m: {"weight": w} for m, w in (flavors or {}).items()},
        **({"policy": policy} if policy is not None else {}),
    })


def job(job_id: str, queue: str, gpus: int = 1, *, count: int = 1, models: tuple[str, ...] = (H100,),
        team: str | None = None, priority: str = "normal", mig: str | None = None,
        pod_sets: tuple[PodSet, ...] | None = None, preemptible: bool | None = None) -> JobSpec:
    if pod_sets is None:
        pod_sets = (PodSet(count=count, gpus_per_pod=1 if mig else gpus, gpu_models=models, mig_profile=mig),)
    return JobSpec(job_id=job_id, team=team or queue, queue=queue, priority_class=priority,
                   pod_sets=pod_sets, preemptible=preemptible)


def submit(state: AdmissionState, spec: JobSpec, t: float = 0.0) -> None:
    rejection = state.submit(Workload(spec, t))
    assert rejection is None, rejection


def submit_many(state: AdmissionState, queue: str, n: int, gpus: int = 1, *, t0: float = 0.0,
                prefix: str | None = None, **kw: Any) -> list[str]:
    ids = []
    for i in range(n):
        job_id = f"{prefix or queue}-{i}"
        submit(state, job(job_id, queue, gpus, **kw), t0 + i)
        ids.append(job_id)
    return ids


def restore_borrower(state: AdmissionState, spec: JobSpec, t: float = 0.0) -> None:
    """A job admitted on borrowed quota before a restart (or before non-preemptible jobs stopped borrowing): the
    only way a non-preemptible borrower still exists."""
    state.restore_admitted(AdmittedWorkload(spec=spec, submitted_at=t, admitted_at=t,
                                            flavors={ps.name: H100 for ps in spec.pod_sets},
                                            usage={H100: spec.total_gpus}, borrowing=True))
