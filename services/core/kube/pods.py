"""What a job's pods say: how many are Ready, whether one failed and why, whether one cannot run where it was
placed, whether an image cannot be pulled. Also the requeue backoff of gangs that were not Ready in time."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.events import ExitReason

IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})


def ready(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if status.get("phase") == "Succeeded":
        return True  # a finished member counted toward the gang (short workers of a JobSet)
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def ready_count(pods: Iterable[Mapping[str, Any]]) -> int:
    return sum(1 for p in pods if ready(p))


@dataclass(frozen=True)
class PodFailure:
    pod: str
    reason: ExitReason
    message: str


def failure(pod: Mapping[str, Any]) -> PodFailure | None:
    """Why a pod failed: OOMKilled, Evicted, or a non-zero exit code (Error); None if it did not fail."""
    status = pod.get("status") or {}
    name = (pod.get("metadata") or {}).get("name", "?")
    if status.get("reason") == "Evicted":
        return PodFailure(name, ExitReason.EVICTED, f"pod {name} was evicted: {status.get('message') or ''}".strip())
    for cs in sorted(status.get("containerStatuses") or [], key=lambda c: c.get("name", "")):
        for state in (cs.get("state") or {}, cs.get("lastState") or {}):
            term = state.get("terminated")
            if not term:
                continue
            code = int(term.get("exitCode", 0))
            if term.get("reason") == "OOMKilled":
                return PodFailure(name, ExitReason.OOM_KILLED,
                                  f"container {cs.get('name')} of pod {name} was OOMKilled (exit code {code})")
            if code != 0 and status.get("phase") == "Failed":
                return PodFailure(name, ExitReason.ERROR,
                                  f"container {cs.get('name')} of pod {name} exited with code {code}"
                                  + (f" ({term['reason']})" if term.get("reason") else ""))
    if status.get("phase") == "Failed":
        return PodFailure(name, ExitReason.ERROR, f"pod {name} failed: {status.get('reason') or 'unknown reason'}")
    return None


def image_pull_problem(pod: Mapping[str, Any]) -> str | None:
    """The waiting reason and message when a container's image cannot be pulled."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_PULL_REASONS:
            return f"{waiting['reason']}: {waiting.get('message') or cs.get('image', '')}".strip()
    return None


# Why a kubelet rejects a pod bound to its node (its admission handlers): a resource the node does not have after all
# (`OutOf<resource>`, e.g. OutOfnvidia.com/gpu when the device plugin reports fewer healthy GPUs), the device
# plugin failing to allocate (UnexpectedAdmissionError), or a predicate the node no longer passes.
KUBELET_REJECTIONS = frozenset({"UnexpectedAdmissionError", "NodeAffinity", "NodeName", "NodePorts",
                                "TaintToleration", "NodeSelectorMismatching", "MatchNodeSelector", "PredicateFailed",
                                "InvalidNodeInfo"})


def rejected(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) when the kubelet rejected the pod where it was bound (phase Failed, the admission reason):
    the node refused it, the pod itself did nothing wrong."""
    status = pod.get("status") or {}
    reason = status.get("reason") or ""
    if status.get("phase") != "Failed" or not (reason.startswith("OutOf") or reason in KUBELET_REJECTIONS):
        return None
    return reason, status.get("message") or ""


def unschedulable(pod: Mapping[str, Any]) -> str | None:
    """kube-scheduler's message when an ungated pod cannot bind where gpuq placed it."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return c.get("message") or "Unschedulable"
    return None


def requeue_delay_s(attempt: int, base_s: float) -> float:
    """Exponential backoff before the n-th requeue (1-based): base, 2×base, 4×base, … capped at one hour."""
    return float(min(3600.0, base_s * 2.0 ** max(0, attempt - 1)))
