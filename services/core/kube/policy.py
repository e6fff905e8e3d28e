"""What Kubernetes would run, judged by the team's governance policy (queues.yaml `governance`) with the rules
event-submitted jobs are judged by (services/core/admission/governance.py), so that a workload created with kubectl,
Argo or a notebook gets no more than a job submitted as an event. Called by the admission webhook and again at
intake (a cluster without the webhook, or a workload created while it was down, is still judged).

Every pod template of the workload is read (`WorkloadKind.all_templates`: a RayJob's idle worker groups and its
submitter too) and every container of each (init, main, ephemeral): images, inline environment values, volumes
(host paths, NFS exports, PersistentVolumeClaims and clones against the dataset allow-list, direct storage), the
ServiceAccount, privileged settings and host namespaces. Each container is judged as one event-submitted pod
template (image, env, the pod's volumes), so the very same functions decide."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import ValidationError

from services.core.admission import governance as g
from services.core.kube.workload import Obj, WorkloadKind
from shared.config import TeamPolicy
from shared.domain import EnvVar, JobSpec, PodSet, PodTemplate


def _env(container: Mapping[str, Any]) -> tuple[EnvVar, ...]:
    """Values written inline (a `valueFrom` is a reference: nothing to judge)."""
    return tuple(EnvVar(name=str(e.get("name") or "?"), value=str(e["value"]))
                 for e in container.get("env") or () if isinstance(e, Mapping) and e.get("value") not in (None, ""))


def _as_specs(job_id: str, team: str, queue: str, labels: Mapping[str, str], datasets: tuple[str, ...],
              template: Mapping[str, Any]) -> Iterator[JobSpec]:
    """One event-submitted spec per container of the template: its image and env, with the pod's volumes on the
    first (volumes are the pod's, judged once). Labels and named datasets ride on the first as well."""
    pod_spec = template.get("spec") or {}
    first = True
    for c in g.containers(pod_spec):
        image = str(c.get("image") or "")
        if not image:
            continue  # a container without an image is refused by the API server itself
        volumes = tuple(v for v in pod_spec.get("volumes") or () if isinstance(v, Mapping)) if first else ()
        pod = PodTemplate(image=image, env=_env(c), volumes=tuple(dict(v) for v in volumes))
        yield JobSpec(job_id=job_id, team=team, queue=queue, labels=dict(labels) if first else {},
                      datasets=datasets if first else (),
                      pod_sets=(PodSet(name="main", gpus_per_pod=0, cpu_milli=0, memory_mib=0, template=pod),))
        first = False


def workload_violation(kind: WorkloadKind, obj: Obj, *, job_id: str, team: str, queue: str,
                       policy: TeamPolicy, datasets: tuple[str, ...] = ()) -> g.Violation | None:
    """The first breach of the team's policy by any pod template of `obj`, or None."""
    meta = obj.get("metadata") or {}
    name = meta.get("name") or meta.get("generateName") or "?"
    labels = {k: str(v) for k, v in (meta.get("labels") or {}).items() if not str(k).startswith("gpuq.io/")}
    for pod_set in kind.all_templates(obj):
        where = f"{kind.kind} {name}, pod template {pod_set.name}"
        pod_spec = pod_set.template.get("spec") or {}
        try:
            for spec in _as_specs(job_id, team, queue, labels, datasets, pod_set.template):
                violation = g.policy_violation(spec, policy)
                if violation is not None:
                    return g.Violation(violation.reason, f"{where}: {violation.message}", violation.rule)
        except ValidationError as exc:
            first = exc.errors()[0]
            return g.Violation(g.POLICY_VIOLATION, f"{where}: {first['msg']}", "names")
        labels = {}
        violation = (g.host_access_violation(job_id, team, where, pod_spec, policy)
                     or g.service_account_violation(job_id, team, where, _account(pod_spec), policy))
        if violation is not None:
            return violation
    return None


def _account(pod_spec: Mapping[str, Any]) -> str | None:
    account = pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount")
    return str(account) if account else None
