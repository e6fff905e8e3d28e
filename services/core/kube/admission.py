"""The admission webhook's decisions (docs/kubernetes.md, "Admission webhook"): pure, on AdmissionReview v1 JSON.

In a namespace `queues.yaml` maps to a team, every GPU pod runs where gpuq placed it:
- **Mutation** (workloads, CREATE): a workload of a supported kind that asks for GPUs, or names a gpuq queue, is
  suspended, given the namespace's default queue when it names none, and stamped with its user of record (the
  request's `userInfo.username`, never a value the author wrote) in `gpuq.io/user` (like Kueue's
  manageJobsWithoutQueueName). It then waits for gpuq like any workload submitted suspended.
- **Validation** (workloads, CREATE and UPDATE): refused are gpuq's own labels and annotations set or changed by
  anyone but gpuq (`gpuq.io/job-id`, `gpuq.io/user`, `gpuq.io/status` …), a queue the namespace may not use, a
  GPU workload created running or resumed by anyone but gpuq, and pod templates that break the team's governance
  policy (images, inline secrets, volumes, ServiceAccount, privileged settings: core/policy.py).
- **Pods** (CREATE and UPDATE): a GPU pod must carry gpuq's scheduling gate (pods of a workload gpuq placed are
  created with it), and only gpuq removes it. A bare GPU pod is refused with how to submit instead.

Requests by gpuq itself (`trusted_users`: its ServiceAccount) are allowed as they are: it creates event-submitted
workloads, resumes placed ones and ungates their pods. Namespaces not mapped are never touched.

The API server sends only what the chart's CEL matchConditions select (a workload with a `gpuq.io/` key or an
`nvidia.com/` request in any pod template, the stored object too on updates; a GPU pod), so that CPU work does not wait
while gpuq is down. A rule here that acts on anything else must widen them (tests/unit/executor_kube/
test_webhook_match_conditions.py checks they cover every request these rules act on).
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.core.kube import names as n
from services.core.kube.kinds import all_kinds, kind_of
from services.core.kube.kinds import pod as kpod
from services.core.kube.policy import workload_violation
from services.core.kube.quantity import count
from services.core.kube.workload import Obj, WorkloadKind
from services.core.kube.workload import annotations_of as _annotations
from services.core.kube.workload import labels_of as _labels
from services.core.kube.workload import meta_of as _meta
from shared.config import NamespaceMapping, QueuesConfig

# gpuq.io/ keys a workload's author may write (docs/kubernetes.md, "Labels and annotations"); every other gpuq.io/
# key on a workload or its pod templates is gpuq's to write.
USER_LABELS = frozenset({n.QUEUE_LABEL, n.PRIORITY_LABEL})
USER_ANNOTATIONS = frozenset({
    n.CHECKPOINT_ANNOTATION, n.CHECKPOINT_INTERVAL_ANNOTATION, n.MAX_RUNTIME_ANNOTATION, n.MIN_MEMBERS_ANNOTATION,
    n.TOPOLOGY_REQUIRED_ANNOTATION, n.TOPOLOGY_PREFERRED_ANNOTATION, n.GPU_MODELS_ANNOTATION, n.DATASETS_ANNOTATION,
    n.KIND_ANNOTATION, n.PREEMPTIBLE_ANNOTATION, n.RETRY_BACKOFF_LIMIT_ANNOTATION, n.RETRY_BACKOFF_S_ANNOTATION,
    n.RETRY_REASONS_ANNOTATION, n.GROUPS_ANNOTATION, n.REPLICAS_ANNOTATION})
# A plain pod's author may also name its group and the group's size, and its SDK reports checkpoints on it.
PLAIN_POD_LABELS = USER_LABELS | {n.POD_GROUP_LABEL}
PLAIN_POD_ANNOTATIONS = USER_ANNOTATIONS | {n.POD_GROUP_TOTAL_ANNOTATION, n.LAST_CHECKPOINT_ANNOTATION,
                                            n.LAST_CHECKPOINT_STEP_ANNOTATION}
GPUQ_PREFIX = "gpuq.io/"
HOW_TO_SUBMIT = ("create a batch/v1 Job, JobSet, PyTorchJob, TFJob, MPIJob or RayJob asking for the GPUs (suspend: "
                 "true, label gpuq.io/queue), a Kubeflow Notebook (annotated kubeflow-resource-stopped), a "
                 "LeaderWorkerSet (replicas: 0, annotation gpuq.io/groups) or a StatefulSet (replicas: 0, "
                 "annotation gpuq.io/replicas), or a Pod labelled gpuq.io/queue (no controller; pods labelled "
                 "gpuq.io/pod-group run as one gang); gpuq queues it and starts it when it is admitted")


@dataclass(frozen=True)
class WebhookPolicy:
    queues: QueuesConfig
    # Who is gpuq: usernames (its ServiceAccount, `system:serviceaccount:<namespace>:<name>`) whose requests are
    # allowed as they are.
    trusted_users: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Answer:
    allowed: bool
    message: str = ""
    patch: list[dict[str, Any]] = field(default_factory=list)
    warnings: tuple[str, ...] = ()

    @staticmethod
    def refuse(message: str) -> Answer:
        return Answer(False, message)


ALLOW = Answer(True)


@dataclass(frozen=True)
class Review:
    """The parts of an AdmissionReview request the decisions read."""

    uid: str
    operation: str
    group: str
    version: str
    kind: str
    namespace: str
    user: str
    obj: dict[str, Any]
    old: dict[str, Any] | None

    @staticmethod
    def parse(body: Any) -> Review:
        """An AdmissionReview v1 request; ValueError naming what is missing."""
        if not isinstance(body, Mapping) or body.get("apiVersion") != "admission.k8s.io/v1" \
                or body.get("kind") != "AdmissionReview" or not isinstance(body.get("request"), Mapping):
            raise ValueError("not an admission.k8s.io/v1 AdmissionReview with a request")
        req = body["request"]
        kind = req.get("kind") or {}
        if not req.get("uid") or not kind.get("kind"):
            raise ValueError("the AdmissionReview request has no uid or kind")
        obj = req.get("object")
        old = req.get("oldObject")
        return Review(uid=str(req["uid"]), operation=str(req.get("operation") or ""),
                      group=str(kind.get("group") or ""), version=str(kind.get("version") or ""),
                      kind=str(kind["kind"]), namespace=str(req.get("namespace") or ""),
                      user=str((req.get("userInfo") or {}).get("username") or ""),
                      obj=dict(obj) if isinstance(obj, Mapping) else {},
                      old=dict(old) if isinstance(old, Mapping) else None)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


def response(uid: str, answer: Answer) -> dict[str, Any]:
    """The AdmissionReview v1 reply."""
    out: dict[str, Any] = {"uid": uid, "allowed": answer.allowed}
    if not answer.allowed:
        out["status"] = {"code": 403, "reason": "Forbidden", "message": answer.message}
    if answer.patch:
        out["patchType"] = "JSONPatch"
        out["patch"] = base64.b64encode(json.dumps(answer.patch).encode()).decode()
    if answer.warnings:
        out["warnings"] = list(answer.warnings)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": out}


# ----------------------------------------------------------------------------- what an object asks for


def asks_for_gpus(pod_spec: Mapping[str, Any]) -> bool:
    """Whether any container (init ones too) asks for a GPU or a MIG slice."""
    for key in ("initContainers", "containers"):
        for c in pod_spec.get(key) or ():
            res = (c or {}).get("resources") or {}
            for amounts in (res.get("limits") or {}, res.get("requests") or {}):
                for name, amount in amounts.items():
                    if (name == n.GPU_RESOURCE or str(name).startswith(n.MIG_RESOURCE_PREFIX)) and _positive(amount):
                        return True
    return False


def _positive(amount: Any) -> bool:
    try:
        return count(amount) > 0
    except (TypeError, ValueError):
        return True  # the API server refuses a malformed quantity; judge it as asking


def workload_asks_for_gpus(kind: WorkloadKind, obj: Obj) -> bool:
    return any(asks_for_gpus(ps.template.get("spec") or {}) for ps in kind.all_templates(obj))


def _controller(obj: Obj) -> Mapping[str, Any] | None:
    for ref in _meta(obj).get("ownerReferences") or ():
        if ref.get("controller") is True:
            return dict(ref)
    return None


def _child_workload(obj: Obj) -> bool:
    """A workload another supported workload controls (a JobSet's Jobs): gpuq admits its parent; its pods are
    still held by their gate (the parent's placed templates), which the pod rules check."""
    ref = _controller(obj)
    return ref is not None and kind_of(str(ref.get("apiVersion") or ""), str(ref.get("kind") or "")) is not None


# ----------------------------------------------------------------------------- mutation


def _pointer(*parts: str) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def _set(obj: Obj, path: tuple[str, ...], value: Any) -> list[dict[str, Any]]:
    """JSON Patch operations that set `path` in `obj` to `value`, adding the maps on the way that are missing. `obj`
    is the object as the operations before these leave it: a dict is updated to what these do (so that two keys of
    one missing map, such as a Notebook's stop annotation and gpuq.io/user, are not both added as the whole map)."""
    node: Any = obj
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(nxt, Mapping):
            nested: Any = value
            for key in reversed(path[i + 1:]):
                nested = {key: nested}
            if isinstance(node, dict):
                node[part] = copy.deepcopy(nested)
            return [{"op": "add", "path": _pointer(*path[:i + 1]), "value": nested}]
        node = nxt
    op = "replace" if isinstance(node, Mapping) and path[-1] in node else "add"
    if isinstance(node, dict):
        node[path[-1]] = copy.deepcopy(value)
    return [{"op": op, "path": _pointer(*path), "value": value}]


def _suspend_ops(kind: WorkloadKind, obj: Obj) -> list[dict[str, Any]]:
    """The kind's suspend (its merge patch, as JSON Patch operations)."""
    ops: list[dict[str, Any]] = []

    def walk(patch: Mapping[str, Any], path: tuple[str, ...]) -> None:
        for key, value in patch.items():
            if isinstance(value, Mapping):
                walk(value, (*path, key))
            else:
                ops.extend(_set(obj, (*path, key), value))

    walk(kind.suspend_patch(True), ())
    return ops


def mutate(review: Review, policy: WebhookPolicy) -> Answer:
    if review.api_version == "v1" and review.kind == "Pod":
        return _mutate_pod(review, policy)
    kind = kind_of(review.api_version, review.kind)
    mapping = policy.queues.namespace_map.get(review.namespace)
    if (kind is None or mapping is None or review.operation != "CREATE" or review.user in policy.trusted_users
            or _child_workload(review.obj)):
        return ALLOW
    labelled = n.QUEUE_LABEL in _labels(review.obj)
    if not labelled and not workload_asks_for_gpus(kind, review.obj):
        return ALLOW
    ops: list[dict[str, Any]] = []
    warnings = []
    work = copy.deepcopy(review.obj)  # the object as the operations so far leave it
    if not kind.suspended(review.obj):
        for key, value in sorted(kind.hold_annotations(review.obj).items()):
            if key not in _annotations(review.obj):
                ops += _set(work, ("metadata", "annotations", key), value)
        ops += _suspend_ops(kind, work)
        warnings.append(f"gpuq suspended this {kind.kind}: it starts when gpuq admits and places it")
    if not labelled:
        ops += _set(work, ("metadata", "labels", n.QUEUE_LABEL), mapping.queues[0])
        warnings.append(f"gpuq queued this {kind.kind} in namespace {review.namespace}'s default queue "
                        f"{mapping.queues[0]} (label {n.QUEUE_LABEL} names another)")
    if n.USER_ANNOTATION not in _annotations(review.obj):  # an author's own value is refused by validation
        ops += _set(work, ("metadata", "annotations", n.USER_ANNOTATION), review.user)
    return Answer(True, patch=ops, warnings=tuple(warnings))


def _mutate_pod(review: Review, policy: WebhookPolicy) -> Answer:
    """A plain pod (labelled gpuq.io/queue, no controller: kinds/pod.py) is held by gpuq's scheduling gate and
    stamped with its user of record. Any other pod is left as it is (a GPU pod without the gate is refused)."""
    if (review.operation != "CREATE" or review.user in policy.trusted_users or not kpod.plain(review.obj)
            or review.namespace not in policy.queues.namespace_map):
        return ALLOW
    work = copy.deepcopy(review.obj)
    ops: list[dict[str, Any]] = []
    if not kpod.gated(review.obj):
        gates = [*((review.obj.get("spec") or {}).get("schedulingGates") or []), {"name": n.PLACEMENT_GATE}]
        ops += _set(work, ("spec", "schedulingGates"), gates)
    if n.USER_ANNOTATION not in _annotations(review.obj):  # an author's own value is refused by validation
        ops += _set(work, ("metadata", "annotations", n.USER_ANNOTATION), review.user)
    return Answer(True, patch=ops, warnings=("gpuq holds this pod (scheduling gate gpuq.io/placement) until it "
                                             "admits and places it",) if ops else ())


# ----------------------------------------------------------------------------- validation


def validate(review: Review, policy: WebhookPolicy) -> Answer:
    mapping = policy.queues.namespace_map.get(review.namespace)
    if mapping is None or review.user in policy.trusted_users or review.operation not in ("CREATE", "UPDATE"):
        return ALLOW
    if review.api_version == "v1" and review.kind == "Pod":
        return _validate_pod(review, mapping, policy)
    kind = kind_of(review.api_version, review.kind)
    if kind is None:
        return ALLOW
    return _validate_workload(review, kind, mapping, policy)


def _reserved_changes(review: Review, user_labels: frozenset[str] = USER_LABELS,
                      user_annotations: frozenset[str] = USER_ANNOTATIONS) -> list[str]:
    """gpuq's own keys the request sets, changes or removes (on CREATE, `gpuq.io/user` may only be the requester
    itself: the mutating webhook wrote it)."""
    new, old = review.obj, review.old or {}
    found = []
    for what, getter, allowed in (("label", _labels, user_labels), ("annotation", _annotations, user_annotations)):
        now, before = getter(new), getter(old)
        for key in sorted({*now, *before}):
            if not key.startswith(GPUQ_PREFIX) or key in allowed or now.get(key) == before.get(key):
                continue
            if (review.operation == "CREATE" and key == n.USER_ANNOTATION and what == "annotation"
                    and now.get(key) == review.user):
                continue
            found.append(f"{what} {key}")
    return found


def _template_changes(kind: WorkloadKind, review: Review) -> list[str]:
    """gpuq's keys in pod templates (its job and pod-set labels, resume point) set or changed by the request."""
    before = {ps.name: ps.template for ps in kind.all_templates(review.old)} if review.old else {}
    found = []
    for ps in kind.all_templates(review.obj):
        meta, old_meta = ps.template.get("metadata") or {}, (before.get(ps.name) or {}).get("metadata") or {}
        for what in ("labels", "annotations"):
            now, then = dict(meta.get(what) or {}), dict(old_meta.get(what) or {})
            found += [f"pod template {ps.name} {what[:-1]} {k}" for k in sorted({*now, *then})
                      if k.startswith(GPUQ_PREFIX) and now.get(k) != then.get(k)]
    return found


def _validate_workload(review: Review, kind: WorkloadKind, mapping: NamespaceMapping,
                       policy: WebhookPolicy) -> Answer:
    obj, name = review.obj, _meta(review.obj).get("name") or _meta(review.obj).get("generateName") or "?"
    what = f"{kind.kind} {review.namespace}/{name}"
    reserved = _reserved_changes(review) + _template_changes(kind, review)
    if reserved:
        return Answer.refuse(f"{what}: {', '.join(reserved)} may be written by gpuq only (user {review.user!r} "
                             "may not set, change or remove them)")
    queue = _labels(obj).get(n.QUEUE_LABEL)
    if queue is not None and queue not in mapping.queues:
        return Answer.refuse(f"{what}: queue {queue!r} is not open to namespace {review.namespace} (allowed: "
                             f"{', '.join(mapping.queues)})")
    gpu = queue is not None or workload_asks_for_gpus(kind, obj)
    if gpu and not _child_workload(obj):
        if review.operation == "CREATE" and not kind.suspended(obj):
            return Answer.refuse(f"{what} asks for GPUs and was not suspended: in namespace {review.namespace} "
                                 f"GPU workloads run through gpuq; {HOW_TO_SUBMIT}")
        if review.old is not None and kind.suspended(review.old) and not kind.suspended(obj):
            return Answer.refuse(f"{what}: only gpuq resumes a GPU workload in namespace {review.namespace} (it does "
                                 f"so when the job is admitted and placed); user {review.user!r} may not")
    if not gpu:
        return ALLOW
    old_templates = [ps.template for ps in kind.all_templates(review.old)] if review.old else None
    if old_templates == [ps.template for ps in kind.all_templates(obj)]:
        return ALLOW  # a metadata change: the pods were judged when they were written
    governance = policy.queues.governance.for_team(mapping.team)
    violation = workload_violation(kind, obj, job_id=f"{review.namespace}.{name}", team=mapping.team,
                                   queue=queue or mapping.queues[0], policy=governance)
    if violation is not None:
        return Answer.refuse(f"{violation.reason} (rule: {violation.rule}): {violation.message}")
    return ALLOW


def _validate_plain_pod(review: Review, mapping: NamespaceMapping, policy: WebhookPolicy) -> Answer | None:
    """A plain pod's rules (kinds/pod.py): a queue its namespace may use, gpuq's keys left to gpuq, held by the gate
    when created, and the team's governance policy. None: not a plain pod (nor was it)."""
    if not kpod.plain(review.obj) and not (review.old is not None and kpod.plain(review.old)):
        return None
    name = _meta(review.obj).get("name") or _meta(review.obj).get("generateName") or "?"
    what = f"pod {review.namespace}/{name}"
    reserved = _reserved_changes(review, PLAIN_POD_LABELS, PLAIN_POD_ANNOTATIONS)
    if reserved:
        return Answer.refuse(f"{what}: {', '.join(reserved)} may be written by gpuq only (user {review.user!r} "
                             "may not set, change or remove them)")
    queue = _labels(review.obj).get(n.QUEUE_LABEL)
    if queue is not None and queue not in mapping.queues:
        return Answer.refuse(f"{what}: queue {queue!r} is not open to namespace {review.namespace} (allowed: "
                             f"{', '.join(mapping.queues)})")
    if review.operation == "CREATE" and not kpod.gated(review.obj):
        return Answer.refuse(f"{what} names a gpuq queue without gpuq's scheduling gate {n.PLACEMENT_GATE}: in "
                             f"namespace {review.namespace} gpuq holds such pods until it places them")
    if review.old is not None and kpod.gated(review.old) and not kpod.gated(review.obj):
        return Answer.refuse(f"{what}: only gpuq removes its scheduling gate {n.PLACEMENT_GATE} (it does so on "
                             "the node it placed the pod on)")
    if review.operation == "CREATE":
        violation = workload_violation(kpod.PLAIN_POD, review.obj, job_id=f"{review.namespace}.{name}",
                                       team=mapping.team, queue=queue or mapping.queues[0],
                                       policy=policy.queues.governance.for_team(mapping.team))
        if violation is not None:
            return Answer.refuse(f"{violation.reason} (rule: {violation.rule}): {violation.message}")
    return ALLOW


def _validate_pod(review: Review, mapping: NamespaceMapping, policy: WebhookPolicy) -> Answer:
    plain = _validate_plain_pod(review, mapping, policy)
    if plain is not None:
        return plain
    spec = review.obj.get("spec") or {}
    if not asks_for_gpus(spec):
        return ALLOW
    name = _meta(review.obj).get("name") or _meta(review.obj).get("generateName") or "?"
    gated = _gated(review.obj)
    if review.operation == "CREATE" and not gated:
        owner = _controller(review.obj)
        by = f" (created by {owner.get('kind')} {owner.get('name')})" if owner else ""
        return Answer.refuse(f"pod {review.namespace}/{name}{by} asks for GPUs without gpuq's placement: in "
                             f"namespace {review.namespace} (team {mapping.team}) GPU pods run through gpuq; "
                             f"{HOW_TO_SUBMIT} (default queue {mapping.queues[0]})")
    if review.old is not None and _gated(review.old) and not gated:
        return Answer.refuse(f"pod {review.namespace}/{name}: only gpuq removes its scheduling gate "
                             f"{n.PLACEMENT_GATE} (it does so on the node it placed the pod on)")
    return ALLOW


def _gated(pod: Obj) -> bool:
    return any(g.get("name") == n.PLACEMENT_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or ())


def supported_resources() -> list[tuple[str, str, str]]:
    """(group, version, plural) of every workload kind the webhook judges (the chart's rules list them)."""
    return [(k.group, k.version, k.plural) for k in all_kinds()]
