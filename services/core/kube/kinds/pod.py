"""Plain pods (Kueue's plain-pod integration): a `v1` Pod labelled `gpuq.io/queue` that no controller owns is a job
of its own, one pod set `main` of one pod; pods sharing the label `gpuq.io/pod-group` in a namespace, each annotated
`gpuq.io/pod-group-total-count`, are one gang job, taken in once that many exist (all or nothing).

A pod cannot be suspended: it is held by gpuq's scheduling gate (`gpuq.io/placement`, which the admission webhook
adds when the pod is created), started by gpuq's labels on it and the gate's removal on the node it placed it on (as
every gpuq pod is), and stopped by being deleted. Nothing recreates a deleted plain pod, so a plain pod's job that is
preempted (or requeued) ends there: its pod is deleted (after the checkpoint request, when its class asks for one)
and the job ends cancelled, its reason saying so. A group's pods are grouped into pod sets by their shape (resources,
node selector, affinity, tolerations): `main` when they are alike, `role-<i>` otherwise (by the first pod's name).

The kind is not in the workload registry (`kinds.all_kinds`): no informer or webhook rule of the other kinds applies
to pods. Its object is the pod itself, or for a group `group_object`'s synthesized object (the group's name, its
first pod's metadata, and `pods`). The executor's plain-pod intake (services/executor/kube/plainpods.py) drives it."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.core.kube import names as n
from services.core.kube.workload import Conclusion, Finish, Obj, PodSetTemplate, WorkloadKind
from services.core.kube.workload import annotations_of as _annotations
from services.core.kube.workload import labels_of as _labels
from services.core.kube.workload import meta_of as _meta

POD_SET = "main"
POD_KIND, GROUP_KIND = "Pod", "PodGroup"  # the job record's kind: one pod, or a group of them
_SHAPE_KEYS = ("nodeSelector", "affinity", "tolerations", "priorityClassName")


def controlled(pod: Obj) -> bool:
    """A controller owns it (a Job's, a StatefulSet's, a ReplicaSet's pod): its owner is the workload, not the pod."""
    return any(ref.get("controller") is True for ref in _meta(pod).get("ownerReferences") or ())


def plain(pod: Obj) -> bool:
    """A pod that is a job itself: labelled `gpuq.io/queue`, and no controller owns it."""
    return n.QUEUE_LABEL in _labels(pod) and not controlled(pod)


def group_of(pod: Obj) -> str | None:
    return _labels(pod).get(n.POD_GROUP_LABEL) or None


def total_count(pod: Obj) -> int:
    """The group's size its pod says; ValueError naming what is wrong."""
    raw = _annotations(pod).get(n.POD_GROUP_TOTAL_ANNOTATION)
    if raw is None:
        raise ValueError(f"pod {_meta(pod).get('name')} of group {group_of(pod)} has no annotation "
                         f"{n.POD_GROUP_TOTAL_ANNOTATION} (the number of pods in the group)")
    try:
        total = int(raw)
    except ValueError:
        raise ValueError(f"annotation {n.POD_GROUP_TOTAL_ANNOTATION}={raw!r} is not a whole number") from None
    if total < 1:
        raise ValueError(f"annotation {n.POD_GROUP_TOTAL_ANNOTATION}={raw!r} is not at least 1")
    return total


def gated(pod: Obj) -> bool:
    return any(g.get("name") == n.PLACEMENT_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or ())


def terminating(pod: Obj) -> bool:
    return bool(_meta(pod).get("deletionTimestamp"))


def phase(pod: Obj) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def bound_to(pod: Obj) -> str | None:
    """The job gpuq bound the pod to (its `gpuq.io/job-id`, written when gpuq started it)."""
    return _annotations(pod).get(n.JOB_ID_ANNOTATION)


def template(pod: Obj) -> dict[str, Any]:
    """The pod as a pod template: its labels, annotations and spec."""
    meta = _meta(pod)
    out: dict[str, Any] = {"metadata": {k: dict(meta.get(k) or {}) for k in ("labels", "annotations")
                                        if meta.get(k)},
                           "spec": copy.deepcopy(dict(pod.get("spec") or {}))}
    return out


def _shape(pod: Obj) -> str:
    spec = pod.get("spec") or {}
    containers = [{"name": c.get("name"), "resources": c.get("resources") or {}}
                  for key in ("initContainers", "containers") for c in spec.get(key) or ()]
    return json.dumps({"containers": containers, **{k: spec.get(k) for k in _SHAPE_KEYS}}, sort_keys=True)


def pod_set_names(pods: Iterable[Obj]) -> dict[str, str]:
    """Each pod's pod set (by pod name): `main` when every pod has the same shape, else `role-<i>` in the order of
    each shape's first pod by name."""
    ordered = sorted(pods, key=lambda p: str(_meta(p).get("name")))
    shapes: dict[str, int] = {}
    for p in ordered:
        shapes.setdefault(_shape(p), len(shapes))
    if len(shapes) == 1:
        return {str(_meta(p).get("name")): POD_SET for p in ordered}
    return {str(_meta(p).get("name")): f"role-{shapes[_shape(p)]}" for p in ordered}


@dataclass(frozen=True)
class GroupState:
    """A group as its pods stand: `obj` (complete, ready to take in), or `waiting` (pods still to come), or
    `problem` (a reason it can never be taken in as it is)."""

    obj: dict[str, Any] | None = None
    waiting: int = 0
    problem: str | None = None


def group_object(name: str, pods: Iterable[Obj]) -> GroupState:
    """The group `name` of `pods` (its live pods not bound to a job yet, in one namespace): complete once as many
    exist as their `gpuq.io/pod-group-total-count` says. The synthesized object has the group's name, the first
    pod's (by name) labels, annotations and uid (the job's id is made of it), the earliest creation time, and the
    pods."""
    members = sorted((p for p in pods if group_of(p) == name), key=lambda p: str(_meta(p).get("name")))
    if not members:
        return GroupState(waiting=1)
    try:
        totals = {total_count(p) for p in members}
    except ValueError as exc:
        return GroupState(problem=str(exc))
    if len(totals) > 1:
        return GroupState(problem=f"the pods of group {name} disagree on {n.POD_GROUP_TOTAL_ANNOTATION} "
                                  f"({', '.join(str(t) for t in sorted(totals))})")
    queues = {_labels(p).get(n.QUEUE_LABEL) for p in members}
    if len(queues) > 1:
        return GroupState(problem=f"the pods of group {name} name different queues "
                                  f"({', '.join(sorted(str(q) for q in queues))})")
    (total,) = totals
    if len(members) > total:
        return GroupState(problem=f"group {name} has {len(members)} pods, more than its "
                                  f"{n.POD_GROUP_TOTAL_ANNOTATION} {total}")
    if len(members) < total:
        return GroupState(waiting=total - len(members))
    lead = _meta(members[0])
    created = sorted(str(_meta(p).get("creationTimestamp")) for p in members if _meta(p).get("creationTimestamp"))
    meta = {"name": name, "namespace": lead.get("namespace"), "uid": lead.get("uid"),
            "labels": dict(lead.get("labels") or {}), "annotations": dict(lead.get("annotations") or {})}
    if created:
        meta["creationTimestamp"] = created[0]
    return GroupState(obj={"apiVersion": "v1", "kind": GROUP_KIND, "metadata": meta,
                           "pods": [copy.deepcopy(dict(p)) for p in members]})


def members(obj: Obj) -> list[Obj]:
    """The pods of a job's object: the group's, or the pod itself."""
    return list(obj.get("pods") or ()) if "pods" in obj else [obj]


def start_patch(job_id: str, pod_set: str, resume_from: str | None) -> dict[str, Any]:
    """A merge patch binding a held pod to its job when gpuq starts it: the job and pod-set labels the pod watch
    finds it by (then given its node and ungated as every gpuq pod is), the job id, and the checkpoint to resume
    from (null: removed), which `GPUQ_RESUME_FROM` reads through the downward API when its containers start."""
    return {"metadata": {"labels": {n.JOB_LABEL: n.job_label(job_id), n.POD_SET_LABEL: pod_set},
                         "annotations": {n.JOB_ID_ANNOTATION: job_id, n.RESUME_FROM_ANNOTATION: resume_from}}}


def pod_finish(pod: Obj) -> Finish | None:
    status = pod.get("status") or {}
    if phase(pod) == "Succeeded":
        return Finish(True, "Succeeded")
    if phase(pod) == "Failed":
        name = _meta(pod).get("name")
        return Finish(False, status.get("reason") or "Failed",
                      f"pod {name} failed" + (f": {status['message']}" if status.get("message") else ""))
    return None


class PlainPod(WorkloadKind):
    api_version, kind, plural = "v1", POD_KIND, "pods"

    def pod_sets(self, obj: Obj) -> list[PodSetTemplate]:
        pods = members(obj)
        names = pod_set_names(pods)
        out: dict[str, PodSetTemplate] = {}
        for p in sorted(pods, key=lambda p: str(_meta(p).get("name"))):
            name = names[str(_meta(p).get("name"))]
            first = out.get(name)
            out[name] = PodSetTemplate(name, 1 + (first.count if first else 0),
                                       first.template if first else template(p))
        return [out[k] for k in sorted(out)]

    def with_templates(self, spec: dict[str, Any], templates: Mapping[str, dict[str, Any]]) -> None:
        """Nothing: a pod's own spec is not rewritten (gpuq labels it and gives it its node: `start_patch`)."""

    def suspended(self, obj: Obj) -> bool:
        """Held: every pod carries gpuq's gate."""
        return all(gated(p) for p in members(obj))

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        """None: a pod is stopped by deleting it (services/executor/kube/plainpods.py)."""
        return {}

    def stopped(self, obj: Obj) -> bool:
        return all(terminating(p) for p in members(obj))

    def finished(self, obj: Obj) -> Finish | None:
        """The pod's end; a group's: failed as soon as one pod failed, succeeded once every pod succeeded."""
        ends = [pod_finish(p) for p in members(obj)]
        failed = [f for f in ends if f is not None and not f.succeeded]
        if failed:
            return failed[0]
        if all(f is not None for f in ends):
            return Finish(True, "Succeeded")
        return None

    def conclusion(self, obj: Obj, reason: str, message: str, now: str) -> Conclusion:
        """Nothing to write: a pod gpuq ends is deleted (its reason is on its Event and `gpuq.io/status`)."""
        return Conclusion({}, status=False)

    def active_deadline_s(self, obj: Obj) -> int | None:
        deadlines = [int(d) for p in members(obj) if (d := (p.get("spec") or {}).get("activeDeadlineSeconds"))]
        return min(deadlines) if deadlines else None


class PodGroup(PlainPod):
    kind = GROUP_KIND


PLAIN_POD = PlainPod()
POD_GROUP = PodGroup()


def kind_of_record(api_version: str, kind: str) -> PlainPod | None:
    """The plain-pod kind of a job record (`executor.kube_jobs` api_version, kind), else None."""
    if api_version != "v1":
        return None
    return {POD_KIND: PLAIN_POD, GROUP_KIND: POD_GROUP}.get(kind)
