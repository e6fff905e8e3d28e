"""The resources the fake serves, with the defaulting and update validation of the real API server that matter to
gpuq's executor (pod spec immutability and its gated-pod exceptions, Job template mutability while suspended)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from .errors import invalid

COMMON_FIELDS = frozenset({"metadata.name", "metadata.namespace"})


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...] = ("status",)
    short_names: tuple[str, ...] = ()
    # Field selectors kube-apiserver supports for this kind, besides metadata.name and metadata.namespace.
    fields: frozenset[str] = field(default_factory=frozenset)
    custom: bool = False  # a CRD: no strategic merge patch
    create_only: bool = False  # a review API: POST answers, nothing is stored (tokenreviews)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def selectable_fields(self) -> frozenset[str]:
        return COMMON_FIELDS | self.fields

    def __str__(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


POD_FIELDS = frozenset(
    {
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    }
)
EVENT_FIELDS = frozenset(
    {
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    }
)
NEW_EVENT_FIELDS = frozenset(
    {
        "regarding.kind",
        "regarding.namespace",
        "regarding.name",
        "regarding.uid",
        "regarding.apiVersion",
        "reason",
        "reportingController",
        "type",
    }
)

NAMESPACES = ResourceType(
    "", "v1", "namespaces", "Namespace", False, ("status", "finalize"), ("ns",), frozenset({"status.phase"})
)
NODES = ResourceType("", "v1", "nodes", "Node", False, ("status",), ("no",), frozenset({"spec.unschedulable"}))
PODS = ResourceType("", "v1", "pods", "Pod", True, ("status", "binding", "eviction"), ("po",), POD_FIELDS)
EVENTS = ResourceType("", "v1", "events", "Event", True, (), ("ev",), EVENT_FIELDS)
CONFIGMAPS = ResourceType("", "v1", "configmaps", "ConfigMap", True, (), ("cm",))
SECRETS = ResourceType("", "v1", "secrets", "Secret", True, (), (), frozenset({"type"}))
SERVICES = ResourceType("", "v1", "services", "Service", True, ("status",), ("svc",))
SERVICE_ACCOUNTS = ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True, ("token",), ("sa",))
NEW_EVENTS = ResourceType("events.k8s.io", "v1", "events", "Event", True, (), ("ev",), NEW_EVENT_FIELDS)
JOBS = ResourceType("batch", "v1", "jobs", "Job", True, ("status",), (), frozenset({"status.successful"}))
STATEFULSETS = ResourceType("apps", "v1", "statefulsets", "StatefulSet", True, ("status",), ("sts",))
PRIORITY_CLASSES = ResourceType("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", False, (), ("pc",))
LEASES = ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True, ())
TOKEN_REVIEWS = ResourceType("authentication.k8s.io", "v1", "tokenreviews", "TokenReview", False, (), create_only=True)
RBAC = "rbac.authorization.k8s.io"
CLUSTER_ROLES = ResourceType(RBAC, "v1", "clusterroles", "ClusterRole", False, ())
CLUSTER_ROLE_BINDINGS = ResourceType(RBAC, "v1", "clusterrolebindings", "ClusterRoleBinding", False, ())
ROLES = ResourceType(RBAC, "v1", "roles", "Role", True, ())
ROLE_BINDINGS = ResourceType(RBAC, "v1", "rolebindings", "RoleBinding", True, ())
ADMISSION_GROUP = "admissionregistration.k8s.io"
MUTATING_WEBHOOK_CONFIGURATIONS = ResourceType(
    ADMISSION_GROUP, "v1", "mutatingwebhookconfigurations", "MutatingWebhookConfiguration", False, ()
)
VALIDATING_WEBHOOK_CONFIGURATIONS = ResourceType(
    ADMISSION_GROUP, "v1", "validatingwebhookconfigurations", "ValidatingWebhookConfiguration", False, ()
)
CRDS = ResourceType(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False, ("status",), ("crd",)
)
JOBSETS = ResourceType("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet", True, custom=True)
PYTORCHJOBS = ResourceType("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob", True, custom=True)
# Run by the fake PyTorchJob controller's TFJob and MPIJob variants (controllers/pytorchjob.py).
TFJOBS = ResourceType("kubeflow.org", "v1", "tfjobs", "TFJob", True, custom=True)
MPIJOBS = ResourceType("kubeflow.org", "v2beta1", "mpijobs", "MPIJob", True, custom=True)
RAYJOBS = ResourceType("ray.io", "v1", "rayjobs", "RayJob", True, custom=True)
# Kubeflow's notebook controller (controllers/notebook.py)
NOTEBOOKS = ResourceType("kubeflow.org", "v1", "notebooks", "Notebook", True, custom=True)
# the LeaderWorkerSet controller (controllers/leaderworkerset.py)
LEADERWORKERSETS = ResourceType("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet", True,
                                ("status",), ("lws",), custom=True)
RAYCLUSTERS = ResourceType("ray.io", "v1", "rayclusters", "RayCluster", True, custom=True)
POD_TEMPLATES = ResourceType("", "v1", "podtemplates", "PodTemplate", True, ())
PROVISIONING_REQUESTS = ResourceType(
    "autoscaling.x-k8s.io", "v1", "provisioningrequests", "ProvisioningRequest", True, short_names=("provreq",),
    custom=True
)
# Dynamic Resource Allocation (resource.k8s.io/v1, Kubernetes 1.34+): the objects are stored and served; the fake
# allocates nothing itself (kube-scheduler's DRA plugin is not emulated: see scheduler.py and docs/kubernetes.md).
RESOURCE_GROUP = "resource.k8s.io"
DEVICE_CLASSES = ResourceType(RESOURCE_GROUP, "v1", "deviceclasses", "DeviceClass", False, ())
RESOURCE_SLICES = ResourceType(RESOURCE_GROUP, "v1", "resourceslices", "ResourceSlice", False, (),
                               fields=frozenset({"spec.nodeName", "spec.driver"}))
RESOURCE_CLAIMS = ResourceType(RESOURCE_GROUP, "v1", "resourceclaims", "ResourceClaim", True, ("status",))
RESOURCE_CLAIM_TEMPLATES = ResourceType(RESOURCE_GROUP, "v1", "resourceclaimtemplates", "ResourceClaimTemplate",
                                        True, ())
DRA_RESOURCES = (DEVICE_CLASSES, RESOURCE_SLICES, RESOURCE_CLAIMS, RESOURCE_CLAIM_TEMPLATES)

ALL_RESOURCES: tuple[ResourceType, ...] = (
    NAMESPACES,
    NODES,
    PODS,
    EVENTS,
    CONFIGMAPS,
    SECRETS,
    SERVICES,
    SERVICE_ACCOUNTS,
    NEW_EVENTS,
    JOBS,
    STATEFULSETS,
    PRIORITY_CLASSES,
    LEASES,
    TOKEN_REVIEWS,
    CLUSTER_ROLES,
    CLUSTER_ROLE_BINDINGS,
    ROLES,
    ROLE_BINDINGS,
    MUTATING_WEBHOOK_CONFIGURATIONS,
    VALIDATING_WEBHOOK_CONFIGURATIONS,
    CRDS,
    JOBSETS,
    PYTORCHJOBS,
    TFJOBS,
    MPIJOBS,
    RAYJOBS,
    RAYCLUSTERS,
    NOTEBOOKS,
    LEADERWORKERSETS,
    POD_TEMPLATES,
    PROVISIONING_REQUESTS,
)
ALL_RESOURCES += DRA_RESOURCES
BY_PATH: dict[tuple[str, str, str], ResourceType] = {(r.group, r.version, r.plural): r for r in ALL_RESOURCES}
CUSTOM_RESOURCES = tuple(r for r in ALL_RESOURCES if r.custom)


def crd_object(resource: ResourceType) -> dict[str, Any]:
    """The CustomResourceDefinition a real cluster would hold for a served custom resource."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{resource.plural}.{resource.group}"},
        "spec": {
            "group": resource.group,
            "names": {
                "kind": resource.kind,
                "listKind": f"{resource.kind}List",
                "plural": resource.plural,
                "singular": resource.singular,
            },
            "scope": "Namespaced" if resource.namespaced else "Cluster",
            "versions": [
                {
                    "name": resource.version,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }
            ],
        },
    }


# --- defaulting (what the real API server fills in on create) ---------------------------------------------------


def _default_pod_spec(spec: dict[str, Any]) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.setdefault("resources", {})
        # Requests default to limits for every resource, as the API server does (and extended resources such
        # as nvidia.com/gpu must have requests equal to limits).
        limits = resources.get("limits") or {}
        if limits:
            requests = resources.setdefault("requests", {})
            for name, quantity in limits.items():
                requests.setdefault(name, quantity)
        container.setdefault("imagePullPolicy", "IfNotPresent")
        container.setdefault("terminationMessagePath", "/dev/termination-log")


def default_object(resource: ResourceType, obj: dict[str, Any]) -> None:
    spec = obj.get("spec")
    if resource is PODS:
        spec = obj.setdefault("spec", {})
        _default_pod_spec(spec)
        # The DefaultTolerationSeconds admission plugin: 300 s on not-ready and unreachable nodes.
        tolerations = spec.setdefault("tolerations", [])
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            if not any(t.get("key") == key and t.get("effect") in (None, "", "NoExecute") for t in tolerations):
                tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300})
        status = obj.setdefault("status", {})
        status.setdefault("phase", "Pending")
    elif resource is NAMESPACES:
        obj.setdefault("spec", {"finalizers": ["kubernetes"]})
        obj.setdefault("status", {})["phase"] = "Active"
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
    elif resource is JOBS and isinstance(spec, dict):
        _default_job(obj, spec)
    elif resource is JOBSETS and isinstance(spec, dict):
        for replicated in spec.get("replicatedJobs") or []:
            replicated.setdefault("replicas", 1)
            job_spec = (replicated.get("template") or {}).get("spec") or {}
            job_spec.setdefault("completionMode", "Indexed")
            _default_pod_spec((job_spec.get("template") or {}).setdefault("spec", {}))
        spec.setdefault("suspend", False)
    elif resource in (PYTORCHJOBS, TFJOBS, MPIJOBS) and isinstance(spec, dict):
        key = {PYTORCHJOBS: "pytorchReplicaSpecs", TFJOBS: "tfReplicaSpecs", MPIJOBS: "mpiReplicaSpecs"}[resource]
        for replica in (spec.get(key) or {}).values():
            replica.setdefault("replicas", 1)
            replica.setdefault("restartPolicy", "OnFailure")
            _default_pod_spec((replica.get("template") or {}).setdefault("spec", {}))
        spec.setdefault("runPolicy", {}).setdefault("suspend", False)


def _default_job(obj: dict[str, Any], spec: dict[str, Any]) -> None:
    uid = obj["metadata"]["uid"]
    name = obj["metadata"]["name"]
    restart = ((spec.get("template") or {}).get("spec") or {}).get("restartPolicy")
    if restart not in ("Never", "OnFailure"):
        raise invalid(
            "Job",
            name,
            f'spec.template.spec.restartPolicy: Required value: valid values: "OnFailure", "Never" (got {restart!r})',
        )
    spec.setdefault("parallelism", 1)
    spec.setdefault("completions", spec["parallelism"] if spec.get("completionMode") == "Indexed" else 1)
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    spec.setdefault("podReplacementPolicy", "TerminatingOrFailed")
    if not spec.get("manualSelector"):
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        template_labels = spec.setdefault("template", {}).setdefault("metadata", {}).setdefault("labels", {})
        template_labels.update(
            {
                "batch.kubernetes.io/controller-uid": uid,
                "batch.kubernetes.io/job-name": name,
                "controller-uid": uid,
                "job-name": name,
            }
        )
    _default_pod_spec(spec.setdefault("template", {}).setdefault("spec", {}))


# --- update validation ------------------------------------------------------------------------------------------

# Pod spec fields a plain update may change (validation.ValidatePodUpdate): images, activeDeadlineSeconds, added
# tolerations, removed scheduling gates; and while the pod is still gated, additions to nodeSelector and affinity.
_POD_ALWAYS_MUTABLE = frozenset({"activeDeadlineSeconds", "tolerations", "schedulingGates"})
_POD_MUTABLE_WHILE_GATED = frozenset({"nodeSelector", "affinity"})
_CONTAINER_LISTS = ("containers", "initContainers")


def _without(spec: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    stripped = {k: copy.deepcopy(v) for k, v in spec.items() if k not in keys}
    for name in _CONTAINER_LISTS:
        for container in stripped.get(name) or []:
            container.pop("image", None)
    return stripped


def validate_pod_update(old: dict[str, Any], new: dict[str, Any]) -> None:
    name = old["metadata"]["name"]
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    gated = bool(old_spec.get("schedulingGates"))
    mutable = _POD_ALWAYS_MUTABLE | (_POD_MUTABLE_WHILE_GATED if gated else frozenset())
    if _without(old_spec, mutable) != _without(new_spec, mutable):
        changed = sorted(
            k for k in set(old_spec) | set(new_spec) if k not in mutable and old_spec.get(k) != new_spec.get(k)
        )
        raise invalid(
            "Pod",
            name,
            "spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`, "
            "`spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` (only additions to "
            "existing tolerations), `spec.schedulingGates` (only removals), and while gated additions to "
            f"`spec.nodeSelector` and `spec.affinity` (changed: {', '.join(changed) or 'container fields'})",
        )
    old_gates = [g.get("name") for g in old_spec.get("schedulingGates") or []]
    new_gates = [g.get("name") for g in new_spec.get("schedulingGates") or []]
    if any(gate not in old_gates for gate in new_gates):
        raise invalid(
            "Pod", name, "spec.schedulingGates: Forbidden: only deletion is allowed, but found new scheduling gate"
        )
    old_tolerations = old_spec.get("tolerations") or []
    if any(t not in (new_spec.get("tolerations") or []) for t in old_tolerations):
        raise invalid(
            "Pod",
            name,
            "spec.tolerations: Forbidden: existing toleration can not be modified except its tolerationSeconds",
        )
    old_selector = old_spec.get("nodeSelector") or {}
    new_selector = new_spec.get("nodeSelector") or {}
    if gated and any(new_selector.get(k) != v for k, v in old_selector.items()):
        raise invalid("Pod", name, "spec.nodeSelector: Invalid value: only additions to spec.nodeSelector are allowed")


# A Job's pod template is immutable, except that while the Job is suspended and has never started, the scheduling
# directives may change (the feature Kueue and gpuq use to place a suspended Job before unsuspending it).
_TEMPLATE_MUTABLE_WHILE_SUSPENDED = ("nodeSelector", "tolerations", "affinity", "schedulingGates")


def _scheduling_stripped(template: dict[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(template)
    metadata = stripped.setdefault("metadata", {})
    metadata.pop("labels", None)
    metadata.pop("annotations", None)
    for key in _TEMPLATE_MUTABLE_WHILE_SUSPENDED:
        stripped.setdefault("spec", {}).pop(key, None)
    return stripped


def validate_job_update(old: dict[str, Any], new: dict[str, Any]) -> None:
    name = old["metadata"]["name"]
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    for immutable in ("selector", "completionMode"):
        if old_spec.get(immutable) != new_spec.get(immutable):
            raise invalid("Job", name, f"spec.{immutable}: Invalid value: field is immutable")
    old_template, new_template = old_spec.get("template") or {}, new_spec.get("template") or {}
    if old_template == new_template:
        return
    never_started = old_spec.get("suspend") and not (old.get("status") or {}).get("startTime")
    if not never_started or _scheduling_stripped(old_template) != _scheduling_stripped(new_template):
        raise invalid(
            "Job",
            name,
            "spec.template: Invalid value: field is immutable (only the scheduling directives and the labels and "
            "annotations of the template may change, and only while the Job is suspended and has not started)",
        )


def validate_create(resource: ResourceType, obj: dict[str, Any]) -> None:
    from .cel import validate_configuration
    from .events import validate_core_event, validate_new_event

    if resource is EVENTS:
        validate_core_event(obj)
    elif resource is NEW_EVENTS:
        validate_new_event(obj)
    elif resource in (MUTATING_WEBHOOK_CONFIGURATIONS, VALIDATING_WEBHOOK_CONFIGURATIONS):
        validate_configuration(resource.kind, obj)  # its matchConditions compile


def validate_update(resource: ResourceType, old: dict[str, Any], new: dict[str, Any]) -> None:
    from .cel import validate_configuration

    if resource in (MUTATING_WEBHOOK_CONFIGURATIONS, VALIDATING_WEBHOOK_CONFIGURATIONS):
        validate_configuration(resource.kind, new)
    elif resource is PODS:
        validate_pod_update(old, new)
    elif resource is JOBS:
        validate_job_update(old, new)
