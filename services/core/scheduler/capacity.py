"""What a cluster index holds, summed: free and total GPUs, MIG slices and shared GPUs, per node, per model and per
profile (what `gpuq queues`, the inventory gauges, fragmentation and the ETA read). Read-only: the index (index.py)
keeps the nodes; this part only adds them up."""

from __future__ import annotations

from shared.domain import MILLI_GPU

from .nodes import CallableInt, IndexedNode


class CapacitySummary:
    """The summaries of `ClusterIndex` over its nodes (`_nodes`: name -> IndexedNode, kept by the index)."""

    _nodes: dict[str, IndexedNode]

    def free_on(self, name: str) -> dict[str, int]:
        """Free resources of one node: whole GPUs (or slices), CPU, memory."""
        n = self._nodes[name]
        out = {"gpus": n.free_mask.bit_count(),
               "mig_slices": sum(s.bit_count() for s in n.slice_free or ()) + n.free_slices,
               "cpu_milli": n.cpu, "memory_mib": n.mem}
        if n.sh_share is not None:
            out["shared_milli_gpus"] = sum(MILLI_GPU - used for used in n.sh_share)
        return out

    @property
    def total_gpus(self) -> CallableInt:
        """Physical GPUs on READY nodes (MIG-partitioned GPUs included)."""
        return CallableInt(sum(n.gpus for n in self._nodes.values() if n.ready))

    @property
    def free_gpus(self) -> CallableInt:
        """Free whole GPUs on READY nodes; a partitioned GPU counts when all of its slices are free."""
        return CallableInt(sum(n.free_whole_gpus for n in self._nodes.values() if n.ready))

    @property
    def free_mig_slices(self) -> CallableInt:
        return CallableInt(sum(sum(s.bit_count() for s in n.slice_free or ()) for n in self._nodes.values()
                               if n.ready))

    def free_gpus_by_model(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self._nodes.values():
            if n.ready:
                out[n.spec.gpu_model] = out.get(n.spec.gpu_model, 0) + n.free_whole_gpus
        return dict(sorted(out.items()))

    def free_slices_by_profile(self) -> dict[str, int]:
        """Free MIG slices on READY nodes per admission resource "<model>:<profile>"."""
        out: dict[str, int] = {}
        for n in self._nodes.values():
            if n.ready and n.slice_free is not None and n.spec.mig is not None:
                key = f"{n.spec.gpu_model}:{n.spec.mig.profile}"
                out[key] = out.get(key, 0) + sum(s.bit_count() for s in n.slice_free)
            elif n.ready and n.prof_free is not None:
                for prof, free in n.prof_free.items():
                    key = f"{n.spec.gpu_model}:{prof}"
                    out[key] = out.get(key, 0) + free.bit_count()
        return dict(sorted(out.items()))

    def total_gpus_by_model(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self._nodes.values():
            if n.ready:
                out[n.spec.gpu_model] = out.get(n.spec.gpu_model, 0) + n.gpus
        return dict(sorted(out.items()))

    def used_gpus(self) -> int:
        return int(self.total_gpus) - int(self.free_gpus)

    def shared_usage(self) -> dict[str, int]:
        """On READY nodes' shared GPUs: `gpus` shared, `in_use` of them some pod shares, `milli_gpus` of compute
        the pods there hold."""
        gpus = in_use = milli = 0
        for n in self._nodes.values():
            if n.ready and n.sh_share is not None and n.sh_pods is not None:
                gpus += len(n.sh_share)
                in_use += sum(1 for p in n.sh_pods if p)
                milli += sum(n.sh_share)
        return {"gpus": gpus, "in_use": in_use, "milli_gpus": milli}
