"""Fragmentation for the `gpuq_gpus_fragmented` gauge, from what telemetry knows (nodes and free GPUs per node).

The definition is the scheduler core's (`services.core.scheduler.fragmented_gpus`, also what the simulator
samples): this module only builds the cluster index that function reads from telemetry's facts. Telemetry
sees which GPUs are held but not the CPU and memory placed jobs requested, so the index holds the GPUs
only (the CPU/memory check then sees whole nodes: fragmentation is, if anything, under-counted).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from services.core.scheduler import ClusterIndex
from services.core.scheduler import fragmented_gpus as scheduler_fragmented_gpus
from shared.domain import GpuBinding, JobSpec, NodeHealth, NodeSpec


def cluster_with_free(nodes: Iterable[NodeSpec], free: Mapping[str, int]) -> ClusterIndex:
    """An index of `nodes` where node n has `free[n]` whole GPUs free (the others held, lowest indices first)."""
    nodes = sorted(nodes, key=lambda n: n.name)
    index = ClusterIndex.from_nodes(nodes)
    for n in nodes:
        held = n.gpus - max(0, min(n.gpus, free.get(n.name, 0)))
        if n.mig is not None or held <= 0 or n.health is not NodeHealth.READY:
            continue
        binding = GpuBinding(pod="held-0", node=n.name, gpu_indices=tuple(range(held)))
        index.commit(index.build_placement(f"held-on-{n.name}", (binding,), ()))
    return index


def fragmented_gpus(nodes: Iterable[NodeSpec], free: Mapping[str, int], waiting: Iterable[JobSpec]) -> dict[str, int]:
    """Per ready node with free GPUs: free GPUs no waiting gang can use (all 0 when nothing waits)."""
    return scheduler_fragmented_gpus(cluster_with_free(nodes, free), sorted(waiting, key=lambda s: s.job_id))
