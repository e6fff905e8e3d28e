"""Intake: a suspended workload labelled `gpuq.io/queue` becomes a JobSpec, or is refused with a reason.

The team comes from the namespace through queues.yaml (`namespaces`), never from a label the user writes.
Priority: the `gpuq.io/priority-class` label, else the pod templates' `priorityClassName` through
`kubernetes_priority_classes`, else the configuration's default. Runtime limit: `activeDeadlineSeconds`, else the
`gpuq.io/max-runtime-s` annotation. Checkpoint support: the `gpuq.io/checkpoint` annotation. Retries:
`gpuq.io/retry-backoff-limit` (with `gpuq.io/retry-backoff-s` and `gpuq.io/retry-reasons`), the spec's `retry`.
Where each pod set may run: its template's nodeSelector, node affinity and tolerations, which the scheduler
honours (the job's own tolerations are those every pod set shares). Part of a GPU (issue 47): a template asking
one GPU (`nvidia.com/gpu`, or the renamed `nvidia.com/gpu.shared`) with `gpuq.io/gpu-fraction`,
`gpuq.io/gpu-memory-mib` and optionally `gpuq.io/gpu-sharing` (time-slicing | mps) on the template or the workload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from services.core.kube import names as n
from services.core.kube.policy import workload_violation
from services.core.kube.quantity import count, mebibytes, milli
from services.core.kube.workload import Obj, PodSetTemplate, WorkloadKind
from shared.config import KubernetesSource, QueuesConfig
from shared.domain import (
    CheckpointSpec,
    JobKind,
    JobSpec,
    NodeAffinity,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    PodSet,
    PreferredSchedulingTerm,
    RetryPolicy,
    SelectorOperator,
    TaintEffect,
    Toleration,
    TopologyLevel,
    TopologyRequest,
    WorkloadRef,
)

DEFAULT_MAX_RUNTIME_S = 86_400


@dataclass(frozen=True)
class Refusal:
    """Why a workload is not taken: `reason` is the Kubernetes Event's reason, `message` its text."""

    reason: str
    message: str


def wants_gpuq(obj: Obj) -> bool:
    return n.QUEUE_LABEL in ((obj.get("metadata") or {}).get("labels") or {})


def _resources(template: Mapping[str, Any]) -> tuple[int, str | None, int, int]:
    """GPUs per pod, MIG profile, milli-CPU and MiB of one pod template (limits for extended resources, requests
    for CPU and memory, falling back to limits as Kubernetes does). A replica of `nvidia.com/gpu.shared` counts as
    one GPU (which `_sharing` makes a shared one)."""
    gpus, mig, cpu, mem = 0, None, 0, 0
    for c in (template.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        gpus += count(limits.get(n.GPU_RESOURCE, requests.get(n.GPU_RESOURCE, 0)))
        gpus += count(limits.get(n.SHARED_GPU_RESOURCE, requests.get(n.SHARED_GPU_RESOURCE, 0)))
        for key in sorted(limits):
            if key.startswith(n.MIG_RESOURCE_PREFIX) and count(limits[key]) > 0:
                mig = key.removeprefix(n.MIG_RESOURCE_PREFIX)
        cpu += milli(requests.get("cpu", limits.get("cpu", 0)))
        mem += mebibytes(requests.get("memory", limits.get("memory", 0)))
    return gpus, mig, cpu, mem


def _asks_shared_resource(template: Mapping[str, Any]) -> bool:
    return any(n.SHARED_GPU_RESOURCE in {**((c.get("resources") or {}).get("limits") or {}),
                                         **((c.get("resources") or {}).get("requests") or {})}
               for c in (template.get("spec") or {}).get("containers") or [])


def _sharing(template: Mapping[str, Any], workload: Mapping[str, str], gpus: int) -> dict[str, Any]:
    """The part of a GPU each pod of the template asks (PodSet fields): gpuq.io/gpu-fraction, gpuq.io/gpu-memory-mib
    and gpuq.io/gpu-sharing on the template, else on the workload, for a template asking one GPU. Raises ValueError
    naming what is wrong (a replica of nvidia.com/gpu.shared without a part of a GPU said, a malformed value)."""
    own = ((template.get("metadata") or {}).get("annotations")) or {}
    keys = (n.GPU_FRACTION_ANNOTATION, n.GPU_MEMORY_ANNOTATION, n.GPU_SHARING_ANNOTATION)
    said = {k: own[k] if k in own else workload[k] for k in keys if k in own or k in workload}
    if not said or gpus == 0:
        if _asks_shared_resource(template):
            raise ValueError(f"a pod template asks {n.SHARED_GPU_RESOURCE}: say the part of the GPU each pod needs "
                             f"with the annotation {n.GPU_FRACTION_ANNOTATION} (e.g. 0.25) or "
                             f"{n.GPU_MEMORY_ANNOTATION}")
        return {}
    out: dict[str, Any] = {}
    if n.GPU_FRACTION_ANNOTATION in said:
        try:
            out["gpu_fraction"] = float(said[n.GPU_FRACTION_ANNOTATION])
        except ValueError:
            raise ValueError(f"annotation {n.GPU_FRACTION_ANNOTATION}={said[n.GPU_FRACTION_ANNOTATION]!r} is not a "
                             "number") from None
    if n.GPU_MEMORY_ANNOTATION in said:
        out["gpu_memory_mib"] = _int_annotation(said, n.GPU_MEMORY_ANNOTATION)
    if n.GPU_SHARING_ANNOTATION in said:
        out["gpu_sharing"] = said[n.GPU_SHARING_ANNOTATION]
    return out


def _off_dra_nodes(affinity: NodeAffinity | None) -> NodeAffinity:
    """The affinity with `gpuq.io/dra-driver DoesNotExist` ANDed into every required term: a workload created in the
    cluster asks its GPUs from the device plugin, which a node whose GPUs are DRA devices does not advertise (gpuq
    cannot give a suspended workload's template claims). The label is on gpuq's NodeSpec only, so kube-scheduler
    never sees this requirement."""
    off = NodeSelectorRequirement(key=n.DRA_NODE_LABEL, operator=SelectorOperator.DOES_NOT_EXIST)
    base = affinity or NodeAffinity()
    terms = base.required or (NodeSelectorTerm(),)
    return base.model_copy(update={"required": tuple(
        t.model_copy(update={"match_expressions": (*t.match_expressions, off)}) for t in terms)})


def _requirement(expr: Mapping[str, Any]) -> NodeSelectorRequirement:
    return NodeSelectorRequirement.model_validate({"key": expr.get("key") or "", "operator": expr.get("operator"),
                                                   "values": tuple(str(v) for v in expr.get("values") or ())})


def _term(term: Mapping[str, Any]) -> NodeSelectorTerm:
    return NodeSelectorTerm(match_expressions=tuple(_requirement(e) for e in term.get("matchExpressions") or ()),
                            match_fields=tuple(_requirement(e) for e in term.get("matchFields") or ()))


def _affinity(template: Mapping[str, Any]) -> NodeAffinity | None:
    """The template's node affinity (required terms, preferred terms); pod (anti-)affinity is kube-scheduler's
    alone. Raises ValidationError naming a malformed expression."""
    node = (((template.get("spec") or {}).get("affinity") or {}).get("nodeAffinity")) or {}
    required = (node.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or ()
    preferred = node.get("preferredDuringSchedulingIgnoredDuringExecution") or ()
    if not required and not preferred:
        return None
    return NodeAffinity(required=tuple(_term(t) for t in required),
                        preferred=tuple(PreferredSchedulingTerm(weight=p.get("weight") or 0,
                                                                preference=_term(p.get("preference") or {}))
                                        for p in preferred))


def _node_selector(template: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in ((template.get("spec") or {}).get("nodeSelector") or {}).items()}


def _tolerations(template: Mapping[str, Any]) -> set[Toleration]:
    out = set()
    for t in (template.get("spec") or {}).get("tolerations") or []:
        out.add(Toleration(key=t.get("key") or "", operator=t.get("operator") or "Equal", value=t.get("value") or "",
                           effect=t.get("effect") or None))
    return out


def _models(template: Mapping[str, Any], annotation: str | None, cfg: KubernetesSource) -> tuple[str, ...]:
    if annotation:
        return tuple(sorted({m.strip() for m in annotation.split(",") if m.strip()}))
    product = ((template.get("spec") or {}).get("nodeSelector") or {}).get(cfg.gpu_product_label)
    return (cfg.gpu_flavors.get(product, product),) if product else ()


def _int_annotation(annotations: Mapping[str, str], key: str) -> int | None:
    raw = annotations.get(key)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"annotation {key}={raw!r} is not a whole number") from None


def job_spec(kind: WorkloadKind, obj: Obj, queues: QueuesConfig, cfg: KubernetesSource, *,
             user_of_record: bool = False, dra_nodes: bool = False) -> JobSpec | Refusal:
    """The JobSpec of a workload, or a Refusal naming what is wrong. `user_of_record`: the `gpuq.io/user`
    annotation was written by gpuq's admission webhook from the creating request's user (which refuses a user's own
    value), so it is the job's user; otherwise it is whatever the author wrote and is not used. `dra_nodes`: the
    cluster has nodes whose GPUs are DRA devices, which the workload's GPU pod sets are kept off (`_off_dra_nodes`)."""
    meta = obj.get("metadata") or {}
    namespace, name = meta.get("namespace") or "default", meta["name"]
    labels: dict[str, str] = dict(meta.get("labels") or {})
    annotations: dict[str, str] = dict(meta.get("annotations") or {})
    queue = labels.get(n.QUEUE_LABEL, "")
    mapping = queues.namespace_map.get(namespace)
    if mapping is None:
        return Refusal("UnmappedNamespace", f"namespace {namespace} is not mapped to a team in queues.yaml "
                                            "(namespaces); gpuq leaves this workload suspended")
    if queue not in mapping.queues:
        return Refusal("QueueNotAllowed", f"queue {queue!r} is not open to namespace {namespace} "
                                          f"(allowed: {', '.join(mapping.queues)})")
    pod_sets: list[PodSetTemplate] = kind.pod_sets(obj)
    if not pod_sets:
        return Refusal("NoPodSets", f"{kind.kind} {name} has no pod templates")
    priority = labels.get(n.PRIORITY_LABEL)
    if priority is None:
        k8s_classes = [pc for ps in pod_sets if (pc := (ps.template.get("spec") or {}).get("priorityClassName"))]
        mapped = [queues.kubernetes_priority_classes[pc] for pc in k8s_classes
                  if pc in queues.kubernetes_priority_classes]
        priority = mapped[0] if mapped else (queues.default_priority_class or "normal")
    if priority not in queues.priority_class_map:
        return Refusal("UnknownPriorityClass", f"priority class {priority!r} is not declared in queues.yaml")
    try:
        sets = []
        models_annotation = annotations.get(n.GPU_MODELS_ANNOTATION)
        for ps in pod_sets:
            gpus, mig, cpu, mem = _resources(ps.template)
            sets.append(PodSet(name=ps.name, count=ps.count, gpus_per_pod=1 if mig else gpus,
                               gpu_models=_models(ps.template, models_annotation, cfg), mig_profile=mig,
                               cpu_milli=cpu, memory_mib=mem, node_selector=_node_selector(ps.template),
                               min_count=ps.min_count if ps.min_count is not None and ps.min_count < ps.count
                               else None,
                               affinity=_off_dra_nodes(_affinity(ps.template)) if dra_nodes and (gpus or mig)
                               else _affinity(ps.template), tolerations=_sorted(_tolerations(ps.template)),
                               **_sharing(ps.template, annotations, 0 if mig else gpus)))
        common = set.intersection(*(_tolerations(ps.template) for ps in pod_sets))
        preemptible = annotations.get(n.PREEMPTIBLE_ANNOTATION)
        if _may_use_spot(queues, queue, priority, preemptible):  # the spot flavor: its nodes' gpuq taint
            common.add(SPOT_TOLERATION)
            sets = [ps.model_copy(update={"tolerations": _sorted({*ps.tolerations, SPOT_TOLERATION})}) for ps in sets]
        deadline = kind.active_deadline_s(obj) or _int_annotation(annotations, n.MAX_RUNTIME_ANNOTATION)
        interval = _int_annotation(annotations, n.CHECKPOINT_INTERVAL_ANNOTATION)
        required = annotations.get(n.TOPOLOGY_REQUIRED_ANNOTATION)
        preferred = annotations.get(n.TOPOLOGY_PREFERRED_ANNOTATION)
        uid = meta.get("uid") or ""
        spec = JobSpec(
            job_id=n.cluster_job_id(namespace, name, uid), team=mapping.team, queue=queue, priority_class=priority,
            kind=JobKind(annotations.get(n.KIND_ANNOTATION, kind.job_kind)), pod_sets=tuple(sets),
            min_members=_int_annotation(annotations, n.MIN_MEMBERS_ANNOTATION),
            topology=TopologyRequest(required_level=TopologyLevel(required) if required else None,
                                     preferred_level=TopologyLevel(preferred) if preferred else None),
            tolerations=_sorted(common),
            datasets=tuple(sorted({d.strip() for d in annotations.get(n.DATASETS_ANNOTATION, "").split(",")
                                   if d.strip()})),
            checkpoint=CheckpointSpec(supported=annotations.get(n.CHECKPOINT_ANNOTATION, "").lower() == "true",
                                      interval_s=interval),
            max_runtime_s=deadline or DEFAULT_MAX_RUNTIME_S,
            labels={k: v for k, v in labels.items() if not k.startswith("gpuq.io/")},
            preemptible=None if preemptible is None else preemptible.lower() == "true",
            user=annotations.get(n.USER_ANNOTATION) if user_of_record else None,
            retry=_retry_policy(annotations),
            workload=WorkloadRef(api_version=kind.api_version, kind=kind.kind, namespace=namespace, name=name,
                                 uid=uid or None))
    except (ValidationError, ValueError) as exc:
        return Refusal("InvalidWorkload", _short(exc))
    return spec


def policy_refusal(kind: WorkloadKind, obj: Obj, spec: JobSpec, queues: QueuesConfig) -> Refusal | None:
    """What the workload's pod templates would run, against its team's governance policy (the rules
    event-submitted jobs are judged by): a Refusal `PolicyViolation` naming the rule, or None."""
    violation = workload_violation(kind, obj, job_id=spec.job_id, team=spec.team, queue=spec.queue,
                                   policy=queues.governance.for_team(spec.team), datasets=spec.datasets)
    if violation is None:
        return None
    return Refusal(violation.reason, f"{violation.message} (rule: {violation.rule})" if violation.rule
                   else violation.message)


SPOT_TOLERATION = Toleration(key=n.SPOT_TAINT, operator="Exists", effect=TaintEffect.NO_SCHEDULE)


def _may_use_spot(queues: QueuesConfig, queue: str, priority: str, preemptible: str | None) -> bool:
    """May the job run on spot nodes: its queue says so for preemptible jobs, and it is one (its own
    `gpuq.io/preemptible` annotation, else its priority class)."""
    q = queues.queue_map.get(queue)
    if q is None or not q.spot_for_preemptible:
        return False
    if preemptible is not None:
        return preemptible.lower() == "true"
    return queues.priority_class_map[priority].preemptible


def _sorted(tolerations: set[Toleration]) -> tuple[Toleration, ...]:
    return tuple(sorted(tolerations, key=lambda t: (t.key, t.operator, t.value, str(t.effect))))


def _retry_policy(annotations: Mapping[str, str]) -> RetryPolicy | None:
    limit = _int_annotation(annotations, n.RETRY_BACKOFF_LIMIT_ANNOTATION)
    if limit is None:
        for key in (n.RETRY_BACKOFF_S_ANNOTATION, n.RETRY_REASONS_ANNOTATION):
            if key in annotations:
                raise ValueError(f"annotation {key} needs {n.RETRY_BACKOFF_LIMIT_ANNOTATION}")
        return None
    fields: dict[str, Any] = {"backoff_limit": limit}
    if (raw := annotations.get(n.RETRY_BACKOFF_S_ANNOTATION)) is not None:
        try:
            fields["backoff_s"] = float(raw)
        except ValueError:
            raise ValueError(f"annotation {n.RETRY_BACKOFF_S_ANNOTATION}={raw!r} is not a number") from None
        fields["max_backoff_s"] = max(fields["backoff_s"], RetryPolicy().max_backoff_s)
    if (raw := annotations.get(n.RETRY_REASONS_ANNOTATION)) is not None:
        fields["reasons"] = tuple(r.strip() for r in raw.split(",") if r.strip())
    return RetryPolicy(**fields)


def _short(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors()[:3]:
            loc = ".".join(str(p) for p in err["loc"])
            parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
        return "; ".join(parts)
    return str(exc)
