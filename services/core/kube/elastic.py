"""Telling an elastic workload (and the training code in its pods) how many pods it runs with.

gpuq places an elastic job with `min_count`..`count` pods of its elastic pod sets (docs/scheduler.md, "Elastic
jobs"). The workload is run with the pods placed: its replicas (`WorkloadKind.replicas_patch`: a PyTorchJob's
Worker replicas, a RayJob's worker groups) and the annotations `gpuq.io/target-pods` (the job's pods in all) and
`gpuq.io/target-pods-by-set` (`worker=6`), on the workload and on each pod, where the training code reads them with
`gpuq_sdk.target_pods()` (the downward API, as checkpoint requests are read), before it re-forms its process group
(torchrun's elastic rendezvous does this on its own when pods come or go).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from shared.domain import GpuBinding, JobSpec

from . import names as n
from .workload import Obj, WorkloadKind, merge_patch


def placed_counts(spec: JobSpec, bindings: Iterable[GpuBinding]) -> dict[str, int]:
    """Elastic pod set -> pods placed (its floor when none is: the floor always starts)."""
    counts: dict[str, int] = {}
    for b in bindings:
        name = b.pod.rsplit("-", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return {ps.name: counts.get(ps.name, ps.floor) for ps in spec.pod_sets if ps.elastic}


def target_annotations(spec: JobSpec, counts: Mapping[str, int]) -> dict[str, str]:
    """The target-size annotations for `counts` (elastic pod set -> pods); the fixed pod sets count whole."""
    total = sum(counts.get(ps.name, ps.count) if ps.elastic else ps.count for ps in spec.pod_sets)
    return {n.TARGET_PODS_ANNOTATION: str(total),
            n.TARGET_PODS_BY_SET_ANNOTATION: ",".join(f"{k}={counts[k]}" for k in sorted(counts))}


def resize_patch(kind: WorkloadKind, obj: Obj, spec: JobSpec, counts: Mapping[str, int]) -> dict[str, Any]:
    """A merge patch of the workload that runs `counts` pods of its elastic pod sets and says so in its
    annotations; {} for a job that is not elastic."""
    if not spec.elastic:
        return {}
    patch = kind.replicas_patch(obj, counts)
    patch.setdefault("metadata", {})["annotations"] = target_annotations(spec, counts)
    return patch


def run_elastic(kind: WorkloadKind, obj: Obj, spec: JobSpec, bindings: Iterable[GpuBinding],
                templates: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The run patch of an elastic workload (`WorkloadKind.run_patch` of `templates`) with the pods placed as its
    replicas and the target-size annotations on it and on its pod templates (so that every pod carries them)."""
    counts = placed_counts(spec, bindings)
    notes = target_annotations(spec, counts)
    for name, tmpl in templates.items():
        if name in counts:
            tmpl.setdefault("metadata", {}).setdefault("annotations", {}).update(notes)
    out = kind.run_patch(obj, templates)
    merge_patch(out, resize_patch(kind, obj, spec, counts))
    return out


def pod_notice(spec: JobSpec, counts: Mapping[str, int]) -> dict[str, Any]:
    """A merge patch of one of its pods: the same annotations (what the SDK reads in the pod)."""
    return {"metadata": {"annotations": target_annotations(spec, counts)}}


__all__ = ["placed_counts", "pod_notice", "resize_patch", "run_elastic", "target_annotations"]
