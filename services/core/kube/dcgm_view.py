"""What the Kubernetes executor tells the DCGM source (services/executor/dcgm.py) about where its jobs run.

- **Pods**: every pod carrying a running job's `gpuq.io/job` label in the job's namespace (a pod elsewhere that
  copies the label is not the job's), by `(namespace, name)` as the API has it. The
  names are whatever the workload's controller chose (`<job>-<index>-<random>` for an Indexed Job, the child Jobs'
  pods of a JobSet, `<job>-worker-<i>` for a PyTorchJob, `<cluster>-<group>-worker-<random>` for a RayJob): they are
  read from the pods themselves, never derived, so dcgm-exporter's `pod`/`namespace` labels (or their `exported_*`
  forms) find them for every kind.
- **Nodes**: per node, the GPUs (or MIG slices) each running job holds there, from its placement.
- **Devices**: none. The device plugin, not gpuq, picks which GPU indices a pod gets, so a placement's indices are
  not the pod's. Where dcgm-exporter's pod mapping is missing, the attribution core still knows a job that holds
  every GPU of a node exactly, and splits the node's GPUs between jobs otherwise (approximate).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.core.executor.attribution import Placements, units_by_node
from services.core.kube.names import JOB_LABEL
from shared.domain import GpuBinding


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    job_label: str  # the value of `gpuq.io/job` on its pods
    bindings: Sequence[GpuBinding]
    namespace: str  # its workload's: only pods there are its pods


def placements(running: Iterable[RunningJob], pods: Iterable[Mapping[str, Any]]) -> Placements:
    """The executor's side of the attribution, from its running jobs and the pods its informer holds."""
    jobs = sorted(running, key=lambda j: j.job_id)
    by_label = {(j.namespace, j.job_label): j.job_id for j in jobs}
    by_pod: dict[tuple[str, str], str] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        namespace, name = meta.get("namespace"), meta.get("name")
        job_id = by_label.get((namespace or "", (meta.get("labels") or {}).get(JOB_LABEL, "")))
        if job_id is not None and namespace and name:
            by_pod[(namespace, name)] = job_id
    return Placements(pods=dict(sorted(by_pod.items())),
                      nodes=units_by_node((j.job_id, j.bindings) for j in jobs))
