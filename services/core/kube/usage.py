"""What pods hold on the nodes: every pod bound to a node and not finished, whoever runs it.

kube-scheduler counts a pod's effective requests against its node's allocatable from the moment it is bound until it
is gone (Succeeded or Failed pods hold nothing; a terminating pod still does). gpuq's own pods are accounted by the
scheduler's placements; the others (another scheduler's, a DaemonSet's, an inference Deployment's, a pod created with
`nodeName`) are what a node holds outside gpuq (`NodeSpec.held`), which the scheduler does not place onto.

A pod is gpuq's when it carries the `gpuq.io/job` label (gpuq writes it into the templates it runs). Extended
resources other than `nvidia.com/gpu` (and its shared replicas, `nvidia.com/gpu.shared`: each replica another pod
holds takes a whole GPU out, since the device plugin picks which GPU it is on) and MIG slices
(`nvidia.com/mig-<profile>`) are not modelled.

A node that refused a pod gpuq placed there (`PlacementRefusal`) keeps refusing that shape while its usage is what
it was then: what every pod but the refused job's holds there (`NodeLoads.usage`). `still_refused` keeps the
refusals whose usage has not changed, `with_refusal` adds one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from services.core.kube.names import GPU_RESOURCE, JOB_LABEL, MIG_RESOURCE_PREFIX, SHARED_GPU_RESOURCE
from services.core.kube.quantity import count, mebibytes, milli, parse_quantity
from shared.domain import NodeUsage, PlacementRefusal

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class PodLoad:
    """What one bound pod holds on its node."""

    node: str
    job_label: str | None  # gpuq's pods: their `gpuq.io/job` label
    gpus: int
    mig: tuple[tuple[str, int], ...]  # (profile, slices)
    cpu_milli: int
    memory_mib: int


def requests(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """The pod's effective requests, as kube-scheduler counts them: the sum over its containers (a request left
    out defaults to the limit), at least the largest init container's, plus the pod overhead."""
    spec = pod.get("spec") or {}
    total: dict[str, Decimal] = {}
    for c in spec.get("containers") or ():
        for name, value in _container(c).items():
            total[name] = total.get(name, Decimal(0)) + value
    for c in spec.get("initContainers") or ():
        for name, value in _container(c).items():
            total[name] = max(total.get(name, Decimal(0)), value)
    for name, raw in (spec.get("overhead") or {}).items():
        total[name] = total.get(name, Decimal(0)) + parse_quantity(raw)
    return total


def _container(c: Mapping[str, Any]) -> dict[str, Decimal]:
    res = c.get("resources") or {}
    limits, reqs = res.get("limits") or {}, res.get("requests") or {}
    return {name: parse_quantity(reqs[name] if name in reqs else limits[name]) for name in {*limits, *reqs}}


def pod_load(pod: Mapping[str, Any]) -> PodLoad | None:
    """What the pod holds, or None when it holds nothing on a node (not bound, or finished). Raises ValueError
    naming a malformed quantity."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    node = spec.get("nodeName")
    if not node or status.get("phase") in TERMINAL_PHASES:
        return None
    total = requests(pod)
    mig = tuple(sorted((k.removeprefix(MIG_RESOURCE_PREFIX), count(v)) for k, v in total.items()
                       if k.startswith(MIG_RESOURCE_PREFIX) and v > 0))
    labels = (pod.get("metadata") or {}).get("labels") or {}
    # A replica of a shared GPU (nvidia.com/gpu on a time-sliced or MPS node, or the renamed nvidia.com/gpu.shared)
    # counts as the GPU it may be on: the device plugin, not gpuq, picks which, so each is taken out whole.
    gpus = count(total.get(GPU_RESOURCE, 0)) + count(total.get(SHARED_GPU_RESOURCE, 0))
    return PodLoad(node=node, job_label=labels.get(JOB_LABEL), gpus=gpus, mig=mig,
                   cpu_milli=milli(total.get("cpu", 0)), memory_mib=mebibytes(total.get("memory", 0)))


class NodeLoads:
    """The loads of the bound pods, by node (kept as a pod informer delivers its changes)."""

    def __init__(self) -> None:
        self._pods: dict[str, PodLoad] = {}  # pod key -> its load
        self._by_node: dict[str, set[str]] = {}

    def put(self, key: str, load: PodLoad | None) -> tuple[str, ...]:
        """Record the pod's load now (None: it holds nothing any more); the nodes whose load this changed."""
        old = self._pods.get(key)
        if old == load:
            return ()
        if old is not None:
            del self._pods[key]
            keys = self._by_node[old.node]
            keys.discard(key)
            if not keys:
                del self._by_node[old.node]
        if load is not None:
            self._pods[key] = load
            self._by_node.setdefault(load.node, set()).add(key)
        return tuple(sorted({x.node for x in (old, load) if x is not None}))

    def held(self, node: str, mig_profile: str | None) -> NodeUsage:
        """What the pods gpuq does not manage hold on `node` (MIG slices: those of the node's profile)."""
        return self._sum(node, mig_profile, lambda load: load.job_label is None)

    def held_slices(self, node: str) -> dict[str, int]:
        """MIG slices per profile the pods gpuq does not manage hold on `node` (a mixed-strategy node's profiles)."""
        out: dict[str, int] = {}
        for key in sorted(self._by_node.get(node, ())):
            load = self._pods[key]
            if load.job_label is None:
                for profile, n in load.mig:
                    out[profile] = out.get(profile, 0) + n
        return out

    def usage(self, node: str, mig_profile: str | None, *, but: str | None = None) -> NodeUsage:
        """What every pod on `node` holds, but the pods of the job labelled `but`."""
        return self._sum(node, mig_profile, lambda load: but is None or load.job_label != but)

    def _sum(self, node: str, mig_profile: str | None, counted: Callable[[PodLoad], bool]) -> NodeUsage:
        gpus = slices = cpu = mem = pods = 0
        for key in self._by_node.get(node, ()):
            load = self._pods[key]
            if not counted(load):
                continue
            gpus += load.gpus
            slices += sum(n for profile, n in load.mig if profile == mig_profile)
            cpu += load.cpu_milli
            mem += load.memory_mib
            pods += 1
        return NodeUsage(gpus=gpus, mig_slices=slices, cpu_milli=cpu, memory_mib=mem, pods=pods)


MAX_REFUSALS = 8  # per node: the most recent (a node refusing many shapes refuses the smallest, which covers them)


def still_refused(refused: tuple[PlacementRefusal, ...], usage_of: Callable[[str], NodeUsage]
                  ) -> tuple[PlacementRefusal, ...]:
    """The refusals whose node usage is what it was when they were made (`usage_of(job_id)`: what every pod but that
    job's holds on the node now): a pod left, another came, a job ended, and the node is tried again."""
    return tuple(r for r in refused if usage_of(r.job_id) == r.usage)


def with_refusal(refused: tuple[PlacementRefusal, ...], new: PlacementRefusal) -> tuple[PlacementRefusal, ...]:
    """`refused` and `new`, without the refusals another one covers (a refused shape refuses every larger one)."""
    if any(r.shape.covers(**new.shape.model_dump()) for r in refused):
        return refused  # a smaller shape was refused already: it covers this one
    kept = tuple(r for r in refused if not new.shape.covers(**r.shape.model_dump()))
    return (*kept, new)[-MAX_REFUSALS:]
