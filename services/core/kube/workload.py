"""The adapter interface every workload kind implements (Kueue's GenericJob is the model), and the registry.

A kind is one file under `kinds/`: it says where its pod templates are, how it is suspended, and how it reports
that it finished. Everything else (intake, placement, status) is written once against this interface."""

from __future__ import annotations

import copy
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

Obj = Mapping[str, Any]


# An object's metadata and its maps, read-only and never None (an object may lack any of them).
def meta_of(obj: Obj) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def labels_of(obj: Obj) -> Mapping[str, str]:
    return meta_of(obj).get("labels") or {}


def annotations_of(obj: Obj) -> Mapping[str, str]:
    return meta_of(obj).get("annotations") or {}


@dataclass(frozen=True)
class PodSetTemplate:
    name: str  # gpuq pod set name
    count: int  # pods of this set that run at once (an elastic pod set: the most)
    template: dict[str, Any]  # the PodTemplateSpec (metadata + spec)
    min_count: int | None = None  # elastic (PyTorchJob elasticPolicy, RayJob autoscaling): the fewest pods


@dataclass(frozen=True)
class Finish:
    succeeded: bool
    reason: str  # the workload's condition reason (e.g. BackoffLimitExceeded, DeadlineExceeded)
    message: str = ""


@dataclass(frozen=True)
class Conclusion:
    """How gpuq ends a workload it failed, so that kubectl and Kueue-aware tools read it as failed: a JSON merge
    patch of the object (`status=False`: its controller then records the failure itself) or of its status
    subresource (`status=True`: written as the kind's controller writes a failure, which that controller then
    leaves alone)."""

    patch: dict[str, Any]
    status: bool


# A condition's reason as metav1.Condition allows it (CamelCase words, no spaces): gpuq's reasons already are.
_REASON = re.compile(r"[^A-Za-z0-9_,:]")


def condition_reason(reason: str) -> str:
    cleaned = _REASON.sub("", reason).strip("_,:")
    return cleaned if cleaned[:1].isalpha() else f"Gpuq{cleaned}"


def with_condition(obj: Obj, kind: str, status: str, reason: str, message: str, now: str) -> list[dict[str, Any]]:
    """The object's conditions (metav1.Condition) with `kind` set, in place when present, else appended, as
    `meta.SetStatusCondition` writes them: lastTransitionTime moves only when the status changes."""
    out: list[dict[str, Any]] = []
    found = False
    for c in conditions(obj):
        c = dict(c)
        if c.get("type") == kind:
            found = True
            if c.get("status") != status:
                c["lastTransitionTime"] = now
            c.update(status=status, reason=reason, message=message)
        out.append(c)
    if not found:
        out.append({"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": now})
    return out


def conditions(obj: Obj) -> list[Mapping[str, Any]]:
    return list((obj.get("status") or {}).get("conditions") or [])


def true_condition(obj: Obj, *types: str) -> Mapping[str, Any] | None:
    """The first condition of one of `types` whose status is True."""
    for c in conditions(obj):
        if c.get("type") in types and c.get("status") == "True":
            return c
    return None


class WorkloadKind(ABC):
    api_version: ClassVar[str]  # group/version
    kind: ClassVar[str]
    plural: ClassVar[str]
    job_kind: ClassVar[str] = "training"  # the job class (JobKind) unless annotated `gpuq.io/kind`

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    @abstractmethod
    def pod_sets(self, obj: Obj) -> list[PodSetTemplate]:
        """The pod sets, in a stable order, with their templates as found in the object."""

    def all_templates(self, obj: Obj) -> list[PodSetTemplate]:
        """Every pod template the object holds, including those gpuq does not place (what a policy must read: a
        template that runs no pod now may run one later)."""
        return self.pod_sets(obj)

    @abstractmethod
    def with_templates(self, spec: dict[str, Any], templates: Mapping[str, dict[str, Any]]) -> None:
        """Write `templates` (pod set name -> PodTemplateSpec) into `spec` (a copy the caller owns)."""

    @abstractmethod
    def suspended(self, obj: Obj) -> bool: ...

    def hold_annotations(self, obj: Obj) -> dict[str, str]:
        """Annotations the webhook adds when it holds (suspends) a workload created running, so that what its
        suspension changes can be given back (a LeaderWorkerSet's number of groups)."""
        return {}

    @abstractmethod
    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        """A JSON merge patch that suspends (True) or resumes (False) the workload."""

    @abstractmethod
    def finished(self, obj: Obj) -> Finish | None:
        """Succeeded or failed, from the object's status; None while it runs (or has not started)."""

    def stopped(self, obj: Obj) -> bool:
        """Suspended, and its controller has stopped it (its pods are going): status.startTime cleared, as the Job
        and PyTorchJob controllers do. Only then may gpuq write its failure: a failed workload's controller stops
        reconciling it, and might leave running what it had not stopped yet."""
        return self.suspended(obj) and not (obj.get("status") or {}).get("startTime")

    @abstractmethod
    def conclusion(self, obj: Obj, reason: str, message: str, now: str) -> Conclusion:
        """How to end the (stopped) workload as failed with gpuq's reason and message; `now` in RFC 3339."""

    def active_deadline_s(self, obj: Obj) -> int | None:
        value = (obj.get("spec") or {}).get("activeDeadlineSeconds")
        return int(value) if value is not None else None

    def replicas_patch(self, obj: Obj, counts: Mapping[str, int]) -> dict[str, Any]:
        """A merge patch that runs `counts` (pod set -> pods) of the workload's elastic pod sets; {} for a kind
        that has none (services/core/kube/elastic.py)."""
        return {}

    def build(self, name: str, namespace: str, pod_sets: list[PodSetTemplate], labels: Mapping[str, str],
              annotations: Mapping[str, str]) -> dict[str, Any]:
        """A new object of this kind running `pod_sets` (event-submitted jobs). Kinds that gpuq does not create
        say so."""
        raise NotImplementedError(f"gpuq does not create {self.kind} objects")

    def run_patch(self, obj: Obj, templates: Mapping[str, dict[str, Any]], *, suspend: bool = False
                  ) -> dict[str, Any]:
        """A merge patch that writes `templates` into the object and resumes it (or, with `suspend`, suspends it:
        Kueue's restore, with the templates as the user wrote them)."""
        spec = copy.deepcopy(dict(obj.get("spec") or {}))
        self.with_templates(spec, templates)
        patch = {"spec": spec}
        merge_patch(patch, self.suspend_patch(suspend))
        return patch


def merge_patch(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    """Merge `other` into the patch `into`, mappings key by key (a JSON merge patch's rule for objects)."""
    for k, v in other.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            merge_patch(into[k], v)
        else:
            into[k] = v


_KINDS: dict[tuple[str, str], WorkloadKind] = {}


def register(kind: WorkloadKind) -> WorkloadKind:
    _KINDS[(kind.api_version, kind.kind)] = kind
    return kind


def registered(api_version: str, kind: str) -> WorkloadKind | None:
    """A kind registered so far (services/core/kube/kinds: importing that package registers them all,
    and its `kind_of` and `all_kinds` are what callers use)."""
    return _KINDS.get((api_version, kind))


def every_registered() -> list[WorkloadKind]:
    return [_KINDS[k] for k in sorted(_KINDS)]
