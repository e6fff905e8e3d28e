"""The platform's own history as a simulator trace (`gpuq export-trace`): its finished runs
(services/admission/runsmodel.py) written as the generic CSV (sim/loaders.py: `load_generic_csv`) with the
columns that carry a job's shape and promises as submitted: queue, pods, gpus_per_pod, mig_profile,
checkpoint_interval_s, beside the priority class, the accepted GPU models and the limit (`max_runtime_s`, the
user's estimate). The cluster the platform has now is written as a cluster.yaml of node groups (same model, GPUs,
CPU and memory: one group). `gpuq simulate --trace <csv> --cluster <yaml> --queues <queues.yaml>` replays it; the
queues in force (`--queues-out`) are the baseline a changed queues.yaml is compared against.

Pure: rows and documents from values; the command does the reading and writing (cli/export_trace.py).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from shared.domain import JobSpec, NodeSpec

# The generic CSV's columns, then the ones an exported trace adds (all read by load_generic_csv)
EXPORT_COLUMNS = ("job_id", "submit_time", "duration", "gpus", "team", "priority_class", "gpu_model",
                  "max_runtime_s", "queue", "pods", "gpus_per_pod", "mig_profile", "checkpoint_interval_s")


class ExportError(ValueError):
    """A job the generic trace cannot carry (the message names it and why)."""


def trace_row(spec: JobSpec, submitted_at: float, ran_s: float) -> dict[str, str]:
    """One CSV row: the job as submitted, when (epoch seconds), and how long it ran. A job of several pod sets is
    written as one pod set of their total GPUs (the trace has one shape per job); a shared-GPU one is refused."""
    sets = spec.pod_sets
    if any(p.gpu_fraction is not None or p.gpu_memory_mib is not None for p in sets):
        raise ExportError(f"{spec.job_id}: a shared-GPU pod set (gpu_fraction / gpu_memory_mib) has no trace shape")
    mig = sets[0].mig_profile if len(sets) == 1 else None
    if len(sets) == 1:
        pods, per_pod = sets[0].count, sets[0].gpus_per_pod
    else:
        if any(p.mig_profile for p in sets):
            raise ExportError(f"{spec.job_id}: MIG slices in a job of several pod sets have no trace shape")
        pods, per_pod = 1, spec.total_gpus
    ckpt = spec.checkpoint
    return {
        "job_id": spec.job_id,
        "submit_time": repr(float(submitted_at)),
        "duration": repr(max(1.0, float(ran_s))),
        "gpus": str(pods if mig else pods * per_pod),
        "team": spec.team,
        "priority_class": spec.priority_class,
        "gpu_model": "|".join(spec.gpu_models),
        "max_runtime_s": str(spec.max_runtime_s),
        "queue": spec.queue,
        "pods": str(pods),
        "gpus_per_pod": str(per_pod),
        "mig_profile": mig or "",
        # empty: the job cannot checkpoint (the generic CSV without this column synthesises one)
        "checkpoint_interval_s": str(ckpt.interval_s or 600) if ckpt.supported else "",
    }


def write_trace(runs: Iterable[tuple[JobSpec, float, float]], out: TextIO) -> tuple[int, dict[str, int]]:
    """Write (spec, submitted_at, ran_s) as the trace CSV; returns (rows written, jobs refused by why)."""
    writer = csv.DictWriter(out, fieldnames=EXPORT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    written = 0
    refused: dict[str, int] = {}
    for spec, submitted_at, ran_s in runs:
        try:
            writer.writerow(trace_row(spec, submitted_at, ran_s))
        except ExportError as exc:
            why = str(exc).split(": ", 1)[1]
            refused[why] = refused.get(why, 0) + 1
            continue
        written += 1
    return written, refused


def cluster_document(nodes: Sequence[NodeSpec]) -> dict[str, Any]:
    """A cluster.yaml (static node groups) of `nodes`: one group per (GPU model, GPUs, CPU, memory, MIG layout),
    racks of the loader's default size (the nodes' own racks, taints and labels are not carried)."""
    groups: dict[tuple[str, int, int, int, str], tuple[int, dict[str, Any] | None]] = {}
    for n in nodes:
        mig = n.mig.model_dump(mode="json") if n.mig is not None else None
        key = (n.gpu_model, n.gpus, n.cpu_milli, n.memory_mib, repr(mig))
        groups[key] = (groups.get(key, (0, None))[0] + 1, mig)
    out = []
    for i, ((model, gpus, cpu, mem, _), (count, mig)) in enumerate(sorted(groups.items())):
        group: dict[str, Any] = {"name": f"group-{i}", "count": count, "gpus_per_node": gpus, "gpu_model": model,
                                 "cpu_milli": cpu, "memory_mib": mem}
        if mig is not None:
            group["mig"] = mig
        out.append(group)
    return {"node_groups": out}
