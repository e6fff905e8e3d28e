"""Pod status: Ready counts, OOMKilled / exit code / Evicted, image pulls, unschedulable pods, backoff."""

from __future__ import annotations

from typing import Any

from services.core.kube.pods import (
    failure,
    image_pull_problem,
    ready_count,
    rejected,
    requeue_delay_s,
    unschedulable,
)
from shared.events import ExitReason


def pod(name: str = "p", phase: str = "Running", **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"phase": phase, **status}}


def test_ready_counts_ready_pods_but_not_terminating_ones() -> None:
    ready = pod(conditions=[{"type": "Ready", "status": "True"}])
    going = {**pod(conditions=[{"type": "Ready", "status": "True"}]),
             "metadata": {"name": "g", "deletionTimestamp": "2026-11-30T10:00:00Z"}}
    assert ready_count([ready, pod(), going, pod(phase="Succeeded")]) == 2


def test_oom_killed_is_named() -> None:
    p = pod("w-0", "Failed", containerStatuses=[{"name": "trainer", "state": {"terminated": {
        "exitCode": 137, "reason": "OOMKilled"}}}])
    f = failure(p)
    assert f is not None and f.reason is ExitReason.OOM_KILLED and "OOMKilled (exit code 137)" in f.message


def test_exit_code_and_eviction() -> None:
    p = pod("w-1", "Failed", containerStatuses=[{"name": "trainer", "state": {"terminated": {
        "exitCode": 3, "reason": "Error"}}}])
    f = failure(p)
    assert f is not None and f.reason is ExitReason.ERROR and "exited with code 3" in f.message
    e = failure(pod("w-2", "Failed", reason="Evicted", message="node ran out of ephemeral-storage"))
    assert e is not None and e.reason is ExitReason.EVICTED and "ephemeral-storage" in e.message
    assert failure(pod("ok", "Succeeded", containerStatuses=[{"name": "t", "state": {"terminated": {
        "exitCode": 0}}}])) is None


def test_image_pull_and_unschedulable() -> None:
    p = pod(phase="Pending", containerStatuses=[{"name": "t", "image": "nope:1", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "Back-off pulling image nope:1"}}}])
    assert image_pull_problem(p) == "ImagePullBackOff: Back-off pulling image nope:1"
    u = pod(phase="Pending", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                         "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."}])
    assert "Insufficient nvidia.com/gpu" in (unschedulable(u) or "")
    assert unschedulable(pod()) is None and image_pull_problem(pod()) is None


def test_backoff_doubles_and_is_capped() -> None:
    assert [requeue_delay_s(a, 60) for a in (1, 2, 3)] == [60, 120, 240]
    assert requeue_delay_s(20, 60) == 3600


def test_a_kubelet_rejection_is_the_nodes_refusal_not_the_pods_failure() -> None:
    out_of = {"status": {"phase": "Failed", "reason": "OutOfnvidia.com/gpu",
                         "message": "Pod was rejected: Node didn't have enough resource: nvidia.com/gpu"}}
    assert rejected(out_of) == ("OutOfnvidia.com/gpu", "Pod was rejected: Node didn't have enough resource: "
                                                       "nvidia.com/gpu")
    assert rejected({"status": {"phase": "Failed", "reason": "UnexpectedAdmissionError"}}) == (
        "UnexpectedAdmissionError", "")
    assert rejected({"status": {"phase": "Failed", "reason": "NodeAffinity", "message": "m"}}) == ("NodeAffinity", "m")
    assert rejected({"status": {"phase": "Failed", "reason": "Evicted"}}) is None  # the pod's failure
    assert rejected({"status": {"phase": "Pending", "reason": "OutOfcpu"}}) is None
