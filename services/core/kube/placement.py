"""Placement exactly where gpuq decided, in two steps (as Kueue's topology-aware scheduling does):

1. On JobPlaced, each pod set's template gets the scheduling gate `gpuq.io/placement`, a required node affinity
   restricting it to the nodes gpuq chose for that set, gpuq's labels (to find its pods), and the checkpoint to
   resume from (annotation `gpuq.io/resume-from`, which `GPUQ_RESUME_FROM` reads through the downward API). Then
   the workload is resumed.
2. As each gated pod appears, it is given one binding of its pod set (nodeSelector `kubernetes.io/hostname`, plus
   the job's tolerations) and its gate is removed. kube-scheduler's filters and the device plugin still apply.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.core.kube import names as n
from services.core.kube.workload import PodSetTemplate
from shared.config import PodSecurity
from shared.domain import (
    GpuBinding,
    GpuSharing,
    JobSpec,
    NodeAffinity,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    PodSet,
    PodTemplate,
    SharingMode,
    Toleration,
)
from shared.quota_keys import POOL_LABEL


def pod_set_of(binding: GpuBinding) -> str:
    """Bindings name pods `<pod_set>-<index>`."""
    return binding.pod.rpartition("-")[0]


def nodes_by_pod_set(bindings: Iterable[GpuBinding]) -> dict[str, list[str]]:
    out: dict[str, set[str]] = {}
    for b in bindings:
        out.setdefault(pod_set_of(b), set()).add(b.node)
    return {k: sorted(v) for k, v in sorted(out.items())}


def _affinity_with_nodes(affinity: Mapping[str, Any] | None, nodes: list[str]) -> dict[str, Any]:
    """The user's affinity with `hostname In nodes` ANDed into every required node selector term."""
    out = copy.deepcopy(dict(affinity or {}))
    node_aff = out.setdefault("nodeAffinity", {})
    required = node_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    ours = {"key": n.HOSTNAME_LABEL, "operator": "In", "values": list(nodes)}
    terms = [t for t in required.get("nodeSelectorTerms") or []]
    if not terms:
        terms = [{}]
    new_terms = []
    for term in terms:
        exprs = [e for e in term.get("matchExpressions") or [] if not _is_ours(e)]
        new_terms.append({**term, "matchExpressions": [*exprs, ours]})
    required["nodeSelectorTerms"] = new_terms
    return out


def _is_ours(expr: Mapping[str, Any]) -> bool:
    return expr.get("key") == n.HOSTNAME_LABEL and expr.get("operator") == "In"


def toleration_dicts(tolerations: Iterable[Toleration]) -> list[dict[str, Any]]:
    out = []
    for t in tolerations:
        d: dict[str, Any] = {"key": t.key, "operator": t.operator} if t.key else {"operator": t.operator}
        if t.operator == "Equal":
            d["value"] = t.value
        if t.effect is not None:
            d["effect"] = t.effect.value
        out.append(d)
    return out


def _requirement_dict(r: NodeSelectorRequirement) -> dict[str, Any]:
    out: dict[str, Any] = {"key": r.key, "operator": r.operator.value}
    if r.values:
        out["values"] = list(r.values)
    return out


def _term_dict(t: NodeSelectorTerm) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if t.match_expressions:
        out["matchExpressions"] = [_requirement_dict(r) for r in t.match_expressions]
    if t.match_fields:
        out["matchFields"] = [_requirement_dict(r) for r in t.match_fields]
    return out


def affinity_dict(affinity: NodeAffinity) -> dict[str, Any]:
    """A pod set's NodeAffinity as Kubernetes' `nodeAffinity` (what the scheduler honoured, kube-scheduler enforces)."""
    out: dict[str, Any] = {}
    if affinity.required:
        out["requiredDuringSchedulingIgnoredDuringExecution"] = {
            "nodeSelectorTerms": [_term_dict(t) for t in affinity.required]}
    if affinity.preferred:
        out["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {"weight": p.weight, "preference": _term_dict(p.preference)} for p in affinity.preferred]
    return out


def _union(existing: list[dict[str, Any]], extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = list(existing)
    for t in extra:
        if t not in out:
            out.append(t)
    return out


def placed_template(template: Mapping[str, Any], *, job_id: str, pod_set: str, nodes: list[str],
                    resume_from: str | None) -> dict[str, Any]:
    """The pod template of one pod set as gpuq runs it (from the template as the user wrote it)."""
    out = copy.deepcopy(dict(template))
    meta = out.setdefault("metadata", {})
    meta["labels"] = {**(meta.get("labels") or {}), n.JOB_LABEL: n.job_label(job_id), n.POD_SET_LABEL: pod_set}
    annotations: dict[str, str | None] = dict(meta.get("annotations") or {})
    annotations[n.JOB_ID_ANNOTATION] = job_id
    # A merge patch deletes a key set to null: a previous attempt's resume point must not survive a fresh start.
    annotations[n.RESUME_FROM_ANNOTATION] = resume_from
    meta["annotations"] = annotations
    spec = out.setdefault("spec", {})
    gates = [g for g in spec.get("schedulingGates") or [] if g.get("name") != n.PLACEMENT_GATE]
    spec["schedulingGates"] = [*gates, {"name": n.PLACEMENT_GATE}]
    spec["affinity"] = _affinity_with_nodes(spec.get("affinity"), nodes)
    return out


def restored_template(original: Mapping[str, Any]) -> dict[str, Any]:
    """The template as the user wrote it, as a merge patch over a placed one: gpuq's labels, annotations, gate and
    node restriction are removed (null deletes a key; the lists and the affinity are replaced whole)."""
    out = copy.deepcopy(dict(original))
    meta = out.setdefault("metadata", {})
    labels: dict[str, str | None] = dict(meta.get("labels") or {})
    for key in (n.JOB_LABEL, n.POD_SET_LABEL):
        labels.setdefault(key, None)
    annotations: dict[str, str | None] = dict(meta.get("annotations") or {})
    for key in (n.JOB_ID_ANNOTATION, n.RESUME_FROM_ANNOTATION):
        annotations.setdefault(key, None)
    meta["labels"], meta["annotations"] = labels, annotations
    spec = out.setdefault("spec", {})
    spec["schedulingGates"] = list(spec.get("schedulingGates") or [])
    spec["affinity"] = spec.get("affinity")  # None (deleted) when the user had none
    return out


def placed_templates(pod_sets: list[PodSetTemplate], spec: JobSpec, bindings: Iterable[GpuBinding],
                     resume_from: str | None) -> dict[str, dict[str, Any]]:
    by_set = nodes_by_pod_set(bindings)
    out = {}
    for ps in pod_sets:
        nodes = by_set.get(ps.name)
        if not nodes:
            raise ValueError(f"the placement of {spec.job_id} has no binding for pod set {ps.name}")
        out[ps.name] = placed_template(ps.template, job_id=spec.job_id, pod_set=ps.name, nodes=nodes,
                                       resume_from=resume_from)
    return out


# --------------------------------------------------------------------------- pods


@dataclass(frozen=True)
class PodAssignment:
    pod: str  # pod name
    binding: GpuBinding


def assign_pods(gated: Iterable[str], pod_set: str, bindings: Iterable[GpuBinding],
                taken: Mapping[str, str]) -> list[PodAssignment]:
    """Give each gated pod of `pod_set` (names) one free binding of that set. `taken` maps binding pod ids already
    given to a pod -> that pod. All pods of a set are alike, so the order is only for determinism: pods by name,
    bindings by their pod id (numbers as numbers)."""
    free = sorted((b for b in bindings if pod_set_of(b) == pod_set and b.pod not in taken),
                  key=lambda b: (len(b.pod), b.pod))
    out = []
    for pod, binding in zip(sorted(gated), free, strict=False):
        out.append(PodAssignment(pod, binding))
    return out


def ungate_patch(pod: Mapping[str, Any], node: str, tolerations: Iterable[Toleration]) -> dict[str, Any]:
    """A merge patch giving a gated pod its node and removing gpuq's gate (other gates stay)."""
    spec = pod.get("spec") or {}
    gates = [g for g in spec.get("schedulingGates") or [] if g.get("name") != n.PLACEMENT_GATE]
    return {"spec": {"nodeSelector": {n.HOSTNAME_LABEL: node},
                     "tolerations": _union(list(spec.get("tolerations") or []), toleration_dicts(tolerations)),
                     "schedulingGates": gates}}


def template_gated(template: Mapping[str, Any]) -> bool:
    """Whether a pod template still carries gpuq's gate (a placement was written into it)."""
    return gated(template)


def gated(pod: Mapping[str, Any]) -> bool:
    return any(g.get("name") == n.PLACEMENT_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def pod_node(pod: Mapping[str, Any]) -> str | None:
    """The node a pod was given by gpuq (its hostname selector) or bound to."""
    spec = pod.get("spec") or {}
    return spec.get("nodeName") or (spec.get("nodeSelector") or {}).get(n.HOSTNAME_LABEL)


# --------------------------------------------------------------------------- event-submitted jobs


# The Pod Security Standards' `restricted` profile, as settings of the pods the executor creates: a namespace that
# enforces `restricted` admits them, and none of them can gain privileges.
RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
                        "seccompProfile": {"type": "RuntimeDefault"}}


ISOLATION = {
    SharingMode.TIME_SLICING: "none: time-slicing shares the GPU's memory and faults with every pod on it",
    SharingMode.MPS: "mps: a share of the GPU's threads and a GPU memory limit per pod (CUDA MPS); faults are shared",
}


def isolation_note(pod_set: str, sharing: GpuSharing, nodes: Iterable[str]) -> str:
    """What an Event on the workload says of a pod set sharing GPUs (time-slicing has no isolation)."""
    return (f"pod set {pod_set} shares GPUs by {sharing.mode.value} ({sharing.resource}, {sharing.replicas} pods per "
            f"GPU) on {', '.join(sorted(nodes))}; isolation {ISOLATION[sharing.mode]}")


def _mps_env(ps: PodSet) -> list[dict[str, Any]]:
    """MPS client limits: the thread share from gpu_fraction (percent, at least 1), the pinned memory limit of the
    container's one device (index 0) from gpu_memory_mib."""
    env = []
    if ps.share_milli:
        env.append({"name": n.MPS_THREADS_ENV, "value": str(max(1, min(100, round(ps.share_milli / 10))))})
    if ps.gpu_memory_mib:
        env.append({"name": n.MPS_MEMORY_ENV, "value": f"0={ps.gpu_memory_mib}M"})
    return env


def pod_template(ps: PodSet, tmpl: PodTemplate, *, restart_policy: str = "Never",
                 security: PodSecurity = PodSecurity.RESTRICTED, sharing: GpuSharing | None = None,
                 pool_label: str | None = None) -> dict[str, Any]:
    """A PodTemplateSpec from an event's pod template: resources from the pod set, GPUQ_RESUME_FROM from the
    `gpuq.io/resume-from` annotation (so a later placement can change it without touching the container), and the
    `security` profile's settings (the team's policy, `pod_security`).

    A pod set sharing GPUs (gpu_fraction / gpu_memory_mib) asks one replica of `sharing`'s resource (the node gpuq
    placed it on: `nvidia.com/gpu` or `nvidia.com/gpu.shared`) and is labelled `gpuq.io/gpu-sharing` with its mode
    and annotated `gpuq.io/gpu-isolation` with what isolation it has; under MPS it gets the client limits
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT. Raises ValueError when a shared pod set
    has no node sharing GPUs."""
    limits: dict[str, Any] = dict(tmpl.resources)
    requests: dict[str, Any] = {"cpu": f"{ps.cpu_milli}m", "memory": f"{ps.memory_mib}Mi"}
    env: list[dict[str, Any]] = [{"name": e.name, "valueFrom": copy.deepcopy(e.value_from)} if e.value_from
                                 else {"name": e.name, "value": e.value} for e in tmpl.env
                                 if e.name not in (n.RESUME_ENV, n.MPS_THREADS_ENV, n.MPS_MEMORY_ENV)]
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    if ps.shared:
        if sharing is None:
            raise ValueError(f"pod set {ps.name} shares a GPU but was placed on no node sharing GPUs")
        limits[sharing.resource] = "1"
        labels[n.GPU_SHARING_LABEL] = sharing.mode.value
        annotations[n.GPU_ISOLATION_ANNOTATION] = ISOLATION[sharing.mode]
        if sharing.mode is SharingMode.MPS:
            env.extend(_mps_env(ps))
    elif ps.mig_profile:
        limits[f"{n.MIG_RESOURCE_PREFIX}{ps.mig_profile}"] = "1"
    elif ps.gpus_per_pod:
        limits[n.GPU_RESOURCE] = str(ps.gpus_per_pod)
    env.append({"name": n.RESUME_ENV, "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{n.RESUME_FROM_ANNOTATION}']"}}})
    container: dict[str, Any] = {"name": ps.name.replace("_", "-").replace(".", "-"), "image": tmpl.image,
                                 "resources": {"limits": limits, "requests": requests}, "env": env}
    if tmpl.command:
        container["command"] = list(tmpl.command)
    if tmpl.args:
        container["args"] = list(tmpl.args)
    if tmpl.volume_mounts:
        container["volumeMounts"] = [dict(v) for v in tmpl.volume_mounts]
    pod_security: dict[str, Any] = {}
    if security is PodSecurity.RESTRICTED:
        container["securityContext"] = copy.deepcopy(RESTRICTED_CONTAINER)
        pod_security = copy.deepcopy(RESTRICTED_POD)
    if tmpl.run_as_user is not None:
        pod_security["runAsUser"] = tmpl.run_as_user
    spec: dict[str, Any] = {"restartPolicy": restart_policy, "containers": [container]}
    if pod_security:
        spec["securityContext"] = pod_security
    if tmpl.volumes:
        spec["volumes"] = [dict(v) for v in tmpl.volumes]
    if ps.selector:
        spec["nodeSelector"] = node_selector(ps.selector, pool_label)
    if ps.affinity is not None and (ps.affinity.required or ps.affinity.preferred):
        spec["affinity"] = {"nodeAffinity": affinity_dict(ps.affinity)}
    if ps.own_tolerations:
        spec["tolerations"] = toleration_dicts(ps.own_tolerations)
    if tmpl.service_account_name:
        spec["serviceAccountName"] = tmpl.service_account_name
    if tmpl.termination_grace_period_s is not None:
        spec["terminationGracePeriodSeconds"] = tmpl.termination_grace_period_s
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": spec}


def set_sharing(spec: JobSpec, bindings: Iterable[GpuBinding], sharing_of: Mapping[str, GpuSharing | None]
                ) -> dict[str, tuple[GpuSharing, list[str]]]:
    """Each shared pod set's sharing (its nodes' `sharing_of`, by node name) and its nodes. One template serves
    every pod of a set, so its nodes must ask the same resource in the same mode: the first node's (by name) is
    taken, and a pod on a node advertising another cannot bind there (the placement is then refused and retried)."""
    by_set = nodes_by_pod_set(bindings)
    out = {}
    for ps in spec.pod_sets:
        if not ps.shared:
            continue
        nodes = by_set.get(ps.name, [])
        found = [s for node in nodes if (s := sharing_of.get(node)) is not None]
        if found:
            out[ps.name] = (found[0], nodes)
    return out


def node_selector(selector: Mapping[str, str], pool_label: str | None) -> dict[str, str]:
    """A pod set's selector as the nodes carry it: gpuq's `pool` (which admission may have chosen: docs/admission.md,
    "Node pools as flavors") is the nodes' `kubernetes.pool_label` when one is configured."""
    if not pool_label or POOL_LABEL not in selector:
        return dict(selector)
    return {(pool_label if k == POOL_LABEL else k): v for k, v in selector.items()}


def event_pod_sets(spec: JobSpec, security: PodSecurity = PodSecurity.RESTRICTED,
                   sharing: Mapping[str, tuple[GpuSharing, list[str]]] | None = None,
                   pool_label: str | None = None) -> list[PodSetTemplate]:
    """The pod sets of an event-submitted job, with Kubernetes templates under the `security` profile (`sharing`:
    `set_sharing`'s answer, for the pod sets sharing GPUs; `pool_label`: the nodes' label of gpuq's `pool`)."""
    out = []
    for ps in spec.pod_sets:
        if ps.template is None:
            raise ValueError(f"pod set {ps.name} of {spec.job_id} has no template")
        shared = (sharing or {}).get(ps.name)
        tmpl = pod_template(ps, ps.template, security=security, sharing=shared[0] if shared else None,
                            pool_label=pool_label)
        tmpl["spec"]["tolerations"] = _union(tmpl["spec"].get("tolerations") or [], toleration_dicts(spec.tolerations))
        if not tmpl["spec"]["tolerations"]:
            del tmpl["spec"]["tolerations"]
        out.append(PodSetTemplate(ps.name, ps.count, tmpl))
    return out
