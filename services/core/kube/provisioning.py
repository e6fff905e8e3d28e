"""Capacity that does not exist yet (docs/kubernetes.md, "Capacity: ProvisioningRequest and scale-down").

For the job at the head of its queue that waits for capacity the cluster lacks, in a queue that opts in
(`QueueConfig.provisioning`), gpuq asks the cluster-autoscaler with a ProvisioningRequest
(`autoscaling.x-k8s.io/v1`) and one PodTemplate per pod set, as Kueue's ProvisioningRequest admission check does.
The autoscaler answers in the request's conditions: `Provisioned=True` (the nodes are there: the job is admitted and
placed when the node informer announces them), `Failed=True` (gpuq stops waiting for it, with the autoscaler's
reason, and asks again after a backoff while retries are left). Scale-down: nodes gpuq holds no job on are released
to the autoscaler after a cool-down. Pure: the shell (services/executor/kube/provisioning.py) does the calls."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from services.core.admission.model import Reason as AdmissionReason
from services.core.kube import names as n
from services.core.scheduler.types import Reason as PlacementReason
from shared.config import Provisioning
from shared.domain import JobSpec

API_VERSION = "autoscaling.x-k8s.io/v1"
KIND = "ProvisioningRequest"
# On the pods of a job whose request was provisioned (Kueue's PodSetUpdates): the autoscaler's booked capacity is
# theirs. Both the current keys and the deprecated ones older autoscalers read.
CONSUMES = "autoscaling.x-k8s.io/consume-provisioning-request"
CLASS_NAME = "autoscaling.x-k8s.io/provisioning-class-name"
CONSUMES_OLD = "cluster-autoscaler.kubernetes.io/consume-provisioning-request"
CLASS_NAME_OLD = "cluster-autoscaler.kubernetes.io/provisioning-class-name"
MANAGED_BY = "app.kubernetes.io/managed-by"
# The cluster-autoscaler leaves a node with this annotation "true" alone when it scales down.
SCALE_DOWN_DISABLED = "cluster-autoscaler.kubernetes.io/scale-down-disabled"
IDLE_SINCE = "gpuq.io/idle-since"  # on a node released to the autoscaler: since when gpuq holds no job there
HELD = "gpuq.io/scale-down-held"  # on a node: the scale-down-disabled annotation is gpuq's (it may remove it)

# Why a job waits that more nodes would cure: admission's (quota is there, the cluster is not), and the placement
# core's for an admitted job (the nodes it may use are too few, or none matches its selector, model or taints).
# PlacementRefused is not among them: the cluster turned a pod away where the nodes exist.
ADMISSION_REASONS = frozenset({AdmissionReason.WAITING_FOR_CAPACITY})
PLACEMENT_REASONS = frozenset({
    PlacementReason.INSUFFICIENT_GPUS, PlacementReason.INSUFFICIENT_CPU_MEMORY, PlacementReason.NO_READY_NODES,
    PlacementReason.NO_MATCHING_NODE, PlacementReason.NO_GPU_MODEL, PlacementReason.NO_MIG_SLICES,
    PlacementReason.UNTOLERATED, PlacementReason.TOPOLOGY_UNSATISFIABLE})
MAX_BACKOFF_S = 1800.0

_DNS_INVALID = re.compile(r"[^a-z0-9-]+")


def waits_for_capacity(stage: str, reason: str, position_in_queue: int | None) -> bool:
    """Does a job's pending status say that more nodes would let it run, and is it first in line for them? At
    admission: capacity it lacks, at the head of its queue. At placement: the job is admitted already (ahead of
    everything still queued), and the nodes it may use cannot hold it."""
    if stage == "placement":
        return reason in PLACEMENT_REASONS
    return reason in ADMISSION_REASONS and position_in_queue == 1


def opted_in(provisioning: Provisioning | None, spec: JobSpec) -> bool:
    """The queue asks the autoscaler for this job: it opted in, for every flavor or for one the job may use."""
    if provisioning is None:
        return False
    if not provisioning.flavors:
        return True
    models = {m for ps in spec.pod_sets for m in ps.gpu_models}
    return not models or bool(models & set(provisioning.flavors))


def request_name(workload: str, attempt: int) -> str:
    """`<workload>-gpuq-<attempt>` as a DNS-1123 subdomain (Kueue names its requests `<workload>-<check>-<n>`)."""
    suffix = f"-gpuq-{attempt}"
    base = _DNS_INVALID.sub("-", workload.lower()).strip("-")[: 253 - 64 - len(suffix)].rstrip("-")
    return f"{base}{suffix}"


def template_name(request: str, pod_set: str) -> str:
    """The PodTemplate of one pod set of a request (Kueue's `ppt-<request>-<pod set>`)."""
    return f"ppt-{request}-{_DNS_INVALID.sub('-', pod_set.lower()).strip('-') or 'main'}"[:253]


@dataclass(frozen=True)
class Objects:
    templates: tuple[dict[str, Any], ...]  # PodTemplates, one per pod set, created first
    request: dict[str, Any]  # the ProvisioningRequest that refers to them


def request_objects(*, name: str, namespace: str, owner: Mapping[str, Any], job_id: str, spec: JobSpec,
                    templates: Mapping[str, Mapping[str, Any]], provisioning: Provisioning) -> Objects:
    """The PodTemplates and the ProvisioningRequest for a job: each pod set's template as its user wrote it, with
    `count` pods (the whole gang: an atomic scale-up adds all of it or none). Owned by the workload, so that deleting
    the workload deletes them."""
    owner_ref = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["name"],
                 "uid": owner["uid"], "blockOwnerDeletion": False, "controller": False}
    meta = {"namespace": namespace, "labels": {MANAGED_BY: "gpuq"},
            "annotations": {n.JOB_ID_ANNOTATION: job_id}, "ownerReferences": [owner_ref]}
    pod_templates, pod_sets = [], []
    for ps in spec.pod_sets:
        tmpl = templates.get(ps.name)
        if tmpl is None:
            continue
        tname = template_name(name, ps.name)
        body = copy.deepcopy(dict(tmpl))
        pod_templates.append({"apiVersion": "v1", "kind": "PodTemplate",
                              "metadata": {**copy.deepcopy(meta), "name": tname}, "template": body})
        pod_sets.append({"podTemplateRef": {"name": tname}, "count": ps.count})
    if not pod_sets:
        raise ValueError(f"job {job_id} has no pod template to ask capacity for")
    request = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {**copy.deepcopy(meta), "name": name},
               "spec": {"provisioningClassName": provisioning.class_name.value, "podSets": pod_sets,
                        "parameters": dict(sorted(provisioning.parameters.items()))}}
    return Objects(tuple(pod_templates), request)


@dataclass(frozen=True)
class Verdict:
    state: str  # requested | provisioned | failed
    reason: str
    message: str


def verdict(obj: Mapping[str, Any]) -> Verdict:
    """What the autoscaler said in the request's conditions. Failed (or CapacityRevoked) ends it; Provisioned=True
    is the capacity (BookingExpired after it changes nothing for a job placed meanwhile); otherwise it is still
    being worked on, with the latest condition's reason (check-capacity says CapacityIsNotFound there)."""
    conds = list((obj.get("status") or {}).get("conditions") or [])
    by_type = {c.get("type"): c for c in conds}
    for kind in ("Failed", "CapacityRevoked"):
        c = by_type.get(kind)
        if c is not None and c.get("status") == "True":
            return Verdict("failed", str(c.get("reason") or kind), str(c.get("message") or ""))
    c = by_type.get("Provisioned")
    if c is not None and c.get("status") == "True":
        return Verdict("provisioned", str(c.get("reason") or "Provisioned"), str(c.get("message") or ""))
    latest = max(conds, key=lambda x: str(x.get("lastTransitionTime") or ""), default=None)
    if latest is None:
        return Verdict("requested", "", "")
    return Verdict("requested", str(latest.get("reason") or latest.get("type") or ""),
                   str(latest.get("message") or ""))


def retry_at(failed_at: float, next_attempt: int, provisioning: Provisioning) -> float | None:
    """When the `next_attempt`-th request (2: the first retry) may be made after the one before failed at
    `failed_at`: backoff_s * 2^(retry - 1), at most MAX_BACKOFF_S; None when the retries are spent."""
    retry = next_attempt - 1
    if retry < 1 or retry > provisioning.retry_limit:
        return None
    return failed_at + min(MAX_BACKOFF_S, provisioning.backoff_s * 2.0 ** (retry - 1))


def consume_annotations(name: str, class_name: str) -> dict[str, str]:
    """Annotations on the pod templates of a job placed after its request was provisioned."""
    return {CONSUMES: name, CLASS_NAME: class_name, CONSUMES_OLD: name, CLASS_NAME_OLD: class_name}


def words(row: Mapping[str, Any]) -> str:
    """A request's state in `gpuq explain`'s words."""
    what = f"ProvisioningRequest {row['namespace']}/{row['name']} ({row['class_name'].split('.')[0]})"
    state, reason, message = row["state"], row.get("reason") or "", row.get("message") or ""
    why = f": {reason}" + (f": {message}" if message else "") if reason else ""
    if state == "provisioned":
        return f"capacity asked of the autoscaler: {what} provisioned{why}"
    if state == "failed":
        retry = row.get("retry_at")
        then = "asked again later" if retry is not None else "not asked again (retries spent)"
        return f"capacity asked of the autoscaler: {what} failed{why}; gpuq stopped waiting for it, {then}"
    return f"capacity asked of the autoscaler: {what} waiting for the autoscaler{why}"


# ----------------------------------------------------------------------------- scale-down

@dataclass(frozen=True)
class NodeMark:
    node: str
    annotations: dict[str, str | None]  # a JSON merge patch of metadata.annotations (None removes)


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def scale_down_marks(nodes: Iterable[Mapping[str, Any]], busy: Iterable[str], idle_since: Mapping[str, float],
                     now: float, cooldown_s: float) -> tuple[list[NodeMark], dict[str, float]]:
    """The annotation changes each node needs, and since when each idle node has held no gpuq job.

    A node gpuq holds a job on (placed or running), or held one on less than `cooldown_s` ago, is kept from the
    autoscaler's scale-down (`scale-down-disabled: "true"`: a placed job's pods may not be bound yet, and the next
    job in line may be placed there in a moment); past the cool-down gpuq takes its annotation away and writes
    `gpuq.io/idle-since`, so the autoscaler may remove the node. gpuq only ever removes the annotation it set itself
    (`gpuq.io/scale-down-held`): an administrator's own `scale-down-disabled` stays. An idle node's cool-down counts
    from when it was first seen idle (`idle_since`, or `now`), so a restart never releases a node early."""
    busy_set = set(busy)
    since: dict[str, float] = {}
    marks: list[NodeMark] = []
    for node in sorted(nodes, key=lambda o: str((o.get("metadata") or {}).get("name"))):
        meta = node.get("metadata") or {}
        name = str(meta.get("name"))
        current = meta.get("annotations") or {}
        ours = current.get(HELD) == "true"
        admins = current.get(SCALE_DOWN_DISABLED) == "true" and not ours
        held = name in busy_set
        if not held:
            since[name] = idle_since.get(name, now)
            held = now - since[name] < cooldown_s
        want: dict[str, str | None]
        if held:
            want = {IDLE_SINCE: None} if admins else {SCALE_DOWN_DISABLED: "true", HELD: "true", IDLE_SINCE: None}
        else:
            want = {IDLE_SINCE: _rfc3339(since[name])}
            if ours:
                want.update({SCALE_DOWN_DISABLED: None, HELD: None})
        change = {k: v for k, v in want.items() if current.get(k) != v}
        if change:
            marks.append(NodeMark(name, change))
    return marks, since
