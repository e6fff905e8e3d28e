"""Elastic jobs in a replay: which jobs are elastic (a stated rule, not tuned to any trace) and what the gpuq policy
reports of their sizes to the engine.

Rule (`gpuq-elastic`, and `gpuq-pods1`, its fixed twin): every job asking for 2 or more whole GPUs is replayed as
that many 1-GPU pods; under `gpuq-elastic` it may run with half of them, rounded up, to all of them (PodSet
min_count), under `gpuq-pods1` only with all. Its goodput with n of N pods is its own curve (TraceJob.goodput) or,
when the trace gives none (Philly gives none), linear: n/N of its work per second (sim/model.py `goodput`). The two
twins differ in elasticity alone, so their comparison is elastic against fixed; plain `gpuq` keeps the trace's own
gang shapes (whole-node pods).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from sim.model import TraceJob

PODS1, ELASTIC = "pods1", "elastic"


def as_elastic(job: TraceJob, mode: str | None) -> TraceJob:
    """The job as the rule replays it under `mode` (None: unchanged)."""
    if mode is None or job.mig_profile or job.share_milli or job.gpus < 2:
        return job
    return replace(job, pods=job.gpus, gpus_per_pod=1,
                   min_pods=-(-job.gpus // 2) if mode == ELASTIC else None)


def sizes(placed: Sequence[Any], resizes: Sequence[Any], specs: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Job -> (pods, most pods) for the elastic starts with fewer pods than their most and every resize."""
    out: dict[str, tuple[int, int]] = {}
    for p in placed:
        spec = specs.get(p.job_id)
        if spec is not None and spec.elastic and len(p.bindings) < spec.total_pods:
            out[p.job_id] = (len(p.bindings), spec.total_pods)
    for r in resizes:
        spec = specs.get(r.job_id)
        if spec is not None:
            out[r.job_id] = (r.pods, spec.total_pods)
    return out
