"""What a gang needs and where it may go, and the scratch overlay pods are staged on.

- `resolve`/`trim`: the job's pod sets against admission's flavors (`PodReq`), and the first `min_members` pods;
- `eligible`: the node classes a pod set may use (model, MIG profile, taints), memoised per index;
- `Selection`/`excluded`: the nodes a pod set may not use by their labels (nodeSelector, required node affinity)
  or because they refused a pod of its shape, and `preference`: the score preferred node affinity gives each
  node, memoised per index;
- `Stage`: a scratch copy of the free resources of the nodes a placement touches, minus `Exclusion`s
  (reservations); like Volcano's Statement, nothing is written to the index while staging;
- `GangRequest`/`prepare`: a job resolved against one index, what the placer and the diagnosis share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from shared.domain import GpuBinding, JobSpec, NodeAffinity, NodeSpec, PodSet, Toleration, TopologyLevel

from .index import ClassKey, ClusterIndex
from .types import Placement, Reason, Unplaceable

BIG = 1 << 62  # "no limit" for a pod that asks for none of a resource

Eligibility = tuple[tuple[int, ClassKey], ...]  # (penalty, class key), best penalty first


@dataclass(frozen=True, slots=True)
class Selection:
    """Where a pod set's pods may go by node labels, as kube-scheduler decides it: every `labels` pair
    (nodeSelector) and the required node affinity must match; preferred terms only score the nodes that do."""

    labels: tuple[tuple[str, str], ...]  # nodeSelector, sorted
    affinity: NodeAffinity | None

    def matches(self, node: NodeSpec) -> bool:
        have = node.labels
        return (all(have.get(k) == v for k, v in self.labels)
                and (self.affinity is None or self.affinity.required_matches(have, node.name)))

    def score(self, node: NodeSpec) -> int:
        return self.affinity.score(node.labels, node.name) if self.affinity is not None else 0

    @property
    def restricts(self) -> bool:
        return bool(self.labels) or (self.affinity is not None and bool(self.affinity.required))

    @property
    def prefers(self) -> bool:
        return self.affinity is not None and bool(self.affinity.preferred)

    def keys(self) -> tuple[str, ...]:
        """The label keys the selection reads (to say which values the nodes have)."""
        keys = {k for k, _ in self.labels}
        if self.affinity is not None:
            keys.update(r.key for t in self.affinity.required for r in t.match_expressions)
        return tuple(sorted(keys))

    def describe(self) -> str:
        """The selector as a message names it: `nodeSelector {pool=a100}` and `node affinity zone In [z1]`."""
        parts = []
        if self.labels:
            parts.append("nodeSelector {" + ", ".join(f"{k}={v}" for k, v in self.labels) + "}")
        if self.affinity is not None and self.affinity.required:
            parts.append(f"node affinity {self.affinity.describe_required()}")
        return " and ".join(parts)


def selection_of(ps: PodSet) -> Selection | None:
    """The pod set's Selection, None when it asks nothing of node labels (the common case: no filter at all)."""
    labels = tuple(sorted(ps.selector.items()))
    affinity = ps.affinity if ps.affinity is not None and (ps.affinity.required or ps.affinity.preferred) else None
    if not labels and affinity is None:
        return None
    return Selection(labels, affinity)


@dataclass(frozen=True, slots=True)
class PodReq:
    """One pod set resolved against admission's flavors: what each of its `count` pods needs."""

    pod_set: str
    count: int
    gpus: int  # whole GPUs per pod (0 for MIG and CPU-only pods)
    mig: str | None
    cpu: int
    mem: int
    models: tuple[str, ...]  # empty = any model
    tolerations: tuple[Toleration, ...] = ()  # the pod set's own, on top of the job's
    select: Selection | None = None  # None: any node of an eligible class

    @property
    def unit(self) -> int:
        """Units per pod: whole GPUs on plain nodes, one slice on MIG nodes, none for CPU-only pods."""
        return 1 if self.mig else self.gpus

    @property
    def need(self) -> int:
        return self.count * self.unit


@dataclass(frozen=True, slots=True)
class Exclusion:
    """Resources on one node that a placement must not use (a reservation's future GPUs, CPU, memory)."""

    mask: int
    slices: tuple[tuple[int, int], ...]  # (gpu, slice mask)
    cpu: int
    mem: int


def exclusions_for(placements: Iterable[Placement]) -> dict[str, Exclusion]:
    masks: dict[str, int] = {}
    slices: dict[str, dict[int, int]] = {}
    cpu: dict[str, int] = {}
    mem: dict[str, int] = {}
    for p in placements:
        for i, b in enumerate(p.bindings):
            m = masks.get(b.node, 0)
            for g in b.gpu_indices:
                m |= 1 << g
            masks[b.node] = m
            sl = slices.setdefault(b.node, {})
            if b.mig_slice is not None:
                sl[b.mig_slice[0]] = sl.get(b.mig_slice[0], 0) | (1 << b.mig_slice[1])
            c, r = p.requests[i] if p.requests else (0, 0)
            cpu[b.node] = cpu.get(b.node, 0) + c
            mem[b.node] = mem.get(b.node, 0) + r
    return {n: Exclusion(masks[n], tuple(sorted(slices[n].items())), cpu[n], mem[n]) for n in masks}


def models_text(models: Iterable[str]) -> str:
    models = tuple(models)
    return "/".join(models) if models else "any GPU model"


def resolve(job: JobSpec, allowed: tuple[str, ...]) -> list[PodReq] | Unplaceable:
    reqs = []
    for ps in job.pod_sets:
        models = ps.gpu_models
        if allowed and (ps.gpus_per_pod > 0 or ps.mig_profile):
            models = tuple(m for m in allowed if not ps.gpu_models or m in ps.gpu_models)
            if not models:
                return Unplaceable(job.job_id, Reason.NO_GPU_MODEL,
                                   f"pod set {ps.name} accepts {models_text(ps.gpu_models)} but admission allowed "
                                   f"{models_text(allowed)}")
        gpus = 0 if ps.mig_profile else ps.gpus_per_pod
        reqs.append(PodReq(ps.name, ps.count, gpus, ps.mig_profile, ps.cpu_milli, ps.memory_mib, tuple(models),
                           ps.own_tolerations, selection_of(ps)))
    return reqs


def placement_shape(spec: JobSpec) -> tuple[object, ...]:
    """Everything of a spec that placing it reads but its id (which placement only writes into its answer): the
    pod sets as `resolve` reads them (with their node selection), `min_members` (the gang size), topology,
    tolerations and datasets. Two specs of one shape get the same answer on the same state, but for the job id in it."""
    return (tuple((ps.name, ps.count, ps.gpus_per_pod, ps.gpu_models, ps.mig_profile, ps.cpu_milli, ps.memory_mib,
                   ps.own_tolerations, selection_of(ps))
                  for ps in spec.pod_sets), spec.min_members, spec.topology.required_level,
            spec.topology.preferred_level, spec.tolerations, spec.datasets)


def trim(reqs: list[PodReq], pods: int) -> list[PodReq]:
    """Keep the first `pods` pods in pod-set order (min_members: the gang may start with fewer pods)."""
    out = []
    for r in reqs:
        if pods <= 0:
            break
        take = min(r.count, pods)
        out.append(replace(r, count=take))
        pods -= take
    return out


def eligible(state: ClusterIndex, req: PodReq, tolerations: tuple[Toleration, ...]) -> Eligibility:
    """(penalty, class key) of the classes a pod of `req` may use, best penalty first (memoised per index).
    `tolerations`: the job's; the pod set's own (`req.tolerations`) count too."""
    if req.tolerations:
        tolerations = tolerations + req.tolerations

    def compute() -> Eligibility:
        out = []
        for key, c in state.classes.items():
            if req.models and c.model not in req.models:
                continue
            if req.mig is not None:
                if c.mig != req.mig:
                    continue
            elif req.gpus > 0 and c.mig is not None:
                continue  # whole-GPU pods never land on a partitioned node
            if any(not any(t.tolerates(taint) for t in tolerations) for taint in c.hard):
                continue
            penalty = sum(1 for taint in c.soft if not any(t.tolerates(taint) for t in tolerations))
            out.append((penalty, key))
        return tuple(sorted(out, key=lambda pk: (pk[0], repr(pk[1]))))

    return state.spec_memo(("eligible", req.models, req.mig, req.gpus > 0, tolerations), compute)


NO_NODES: frozenset[str] = frozenset()


def excluded(state: ClusterIndex, req: PodReq) -> frozenset[str]:
    """The nodes a pod of `req` may not use whatever is free on them: those whose labels its selection does not
    match (`unmatched`) and those that refused a pod its shape covers (`refusing`). Depends on the node specs only
    (memoised per index); empty for a pod set that selects nothing on a cluster where no node refused anything."""
    restricts = req.select is not None and req.select.restricts
    if not state.refusing_nodes:
        return unmatched(state, req) if restricts else NO_NODES
    if not restricts:
        return refusing(state, req)
    return state.spec_memo(("excluded", req.select, _shape(req)),
                           lambda: unmatched(state, req) | refusing(state, req))


def unmatched(state: ClusterIndex, req: PodReq) -> frozenset[str]:
    """The nodes whose labels `req`'s selection does not match (nodeSelector, required node affinity)."""
    select = req.select
    if select is None or not select.restricts:
        return NO_NODES

    def compute() -> frozenset[str]:
        return frozenset(name for name, n in state.indexed_nodes.items() if not select.matches(n.spec))

    return state.spec_memo(("unmatched", select), compute)


def _shape(req: PodReq) -> tuple[int, str | None, int, int]:
    return (req.gpus, req.mig, req.cpu, req.mem)


def refusing(state: ClusterIndex, req: PodReq) -> frozenset[str]:
    """The nodes that refused a pod of a shape `req`'s pods cover (`NodeSpec.refused`): not used for them until
    the executor says the node's usage changed (a new spec without the refusal)."""
    if not state.refusing_nodes:
        return NO_NODES
    nodes = state.indexed_nodes

    def compute() -> frozenset[str]:
        return frozenset(name for name in state.refusing_nodes if nodes[name].spec.refuses(*_shape(req)))

    return state.spec_memo(("refusing", _shape(req)), compute)


def preference(state: ClusterIndex, req: PodReq) -> Mapping[str, int]:
    """Node -> the score its preferred node affinity gives it (only nodes scoring above 0; memoised per index)."""
    select = req.select
    if select is None or not select.prefers:
        return {}

    def compute() -> Mapping[str, int]:
        return {name: score for name, n in state.indexed_nodes.items() if (score := select.score(n.spec)) > 0}

    return state.spec_memo(("preference", select), compute)


# ---------------------------------------------------------------------------------- staging overlay


class FreeResources(Protocol):
    """What the stage reads of a node: free whole GPUs (bitmask), free MIG slices per GPU, CPU, memory."""

    free_mask: int
    slice_free: list[int] | None
    cpu: int
    mem: int


class Free:
    """A node's free resources as a scratch copy (a `FreeResources`): what is left on the stage, or what the
    reservation search's replay has freed."""

    __slots__ = ("cpu", "free_mask", "mem", "slice_free")

    def __init__(self, free_mask: int, slice_free: list[int] | None, cpu: int, mem: int):
        self.free_mask = free_mask
        self.slice_free = slice_free
        self.cpu = cpu
        self.mem = mem


class Stage:
    """Scratch copy of the free resources of the nodes a placement touches; the index is never written.
    `nodes` defaults to the index's own records; the reservation search passes its private view of them."""

    __slots__ = ("barred", "exclude", "nodes", "refusals", "slots", "state")

    def __init__(self, state: ClusterIndex, exclude: Mapping[str, Exclusion] | None,
                 nodes: Mapping[str, FreeResources] | None = None):
        self.state = state
        self.exclude = exclude
        self.slots: dict[str, Free] = {}
        self.nodes: Mapping[str, FreeResources] = state.indexed_nodes if nodes is None else nodes
        self.barred: dict[int, frozenset[str]] = {}  # id(req) -> `excluded(state, req)`, for the reqs staged here
        self.refusals = bool(state.refusing_nodes)  # some node refused a pod shape: every req is checked

    def barred_for(self, req: PodReq) -> frozenset[str]:
        """`excluded(state, req)`, looked up once per req on this stage (a req outlives the stage that reads it)."""
        key = id(req)
        got = self.barred.get(key)
        if got is None:
            got = self.barred[key] = excluded(self.state, req)
        return got

    def avail(self, name: str) -> Free:
        s = self.slots.get(name)
        if s is None:
            n = self.nodes[name]
            s = Free(n.free_mask, list(n.slice_free) if n.slice_free is not None else None, n.cpu, n.mem)
            e = self.exclude.get(name) if self.exclude else None
            if e is not None:
                s.free_mask &= ~e.mask
                if s.slice_free is not None:
                    for g, smask in e.slices:
                        if g < len(s.slice_free):
                            s.slice_free[g] &= ~smask
                s.cpu -= e.cpu
                s.mem -= e.mem
            self.slots[name] = s
        return s

    def fits(self, name: str, req: PodReq) -> int:
        """How many pods of `req` the node still holds (none on a node its selection excludes or that refused
        such a pod)."""
        if (req.select is not None or self.refusals) and name in self.barred_for(req):
            return 0
        s = self.avail(name)
        k = BIG
        if req.gpus:
            k = s.free_mask.bit_count() // req.gpus
        elif req.mig:
            k = sum(x.bit_count() for x in s.slice_free or ())
        if req.cpu:
            k = min(k, s.cpu // req.cpu)
        elif s.cpu < 0:
            k = 0
        if req.mem:
            k = min(k, s.mem // req.mem)
        elif s.mem < 0:
            k = 0
        return max(k, 0)

    def take(self, name: str, req: PodReq, first_index: int, k: int, out: list[GpuBinding],
             reqs_out: list[tuple[int, int]]) -> None:
        s = self.slots[name]
        for i in range(k):
            pod = f"{req.pod_set}-{first_index + i}"
            if req.gpus:
                mask = s.free_mask
                picked: list[int] = []
                while len(picked) < req.gpus:
                    low = mask & -mask
                    picked.append(low.bit_length() - 1)
                    mask ^= low
                s.free_mask = mask
                out.append(GpuBinding(pod=pod, node=name, gpu_indices=tuple(picked)))
            elif req.mig and s.slice_free is not None:
                sl = s.slice_free
                # Pack slices: the GPU with the fewest free slices left (lowest index on ties).
                g = min((j for j in range(len(sl)) if sl[j]), key=lambda j: (sl[j].bit_count(), j))
                low = sl[g] & -sl[g]
                sl[g] ^= low
                out.append(GpuBinding(pod=pod, node=name, mig_slice=(g, low.bit_length() - 1)))
            else:
                out.append(GpuBinding(pod=pod, node=name))
            s.cpu -= req.cpu
            s.mem -= req.mem
            reqs_out.append((req.cpu, req.mem))


# ---------------------------------------------------------------------------------- a gang on one index


@dataclass
class GangRequest:
    """A job resolved against one index: its pod sets, the classes each may use, and their union."""

    spec: JobSpec
    reqs: list[PodReq]
    eligs: list[Eligibility]
    union: dict[ClassKey, int]  # class key -> best penalty over pod sets
    need: int  # units of the whole gang
    pods: int


def prepare(state: ClusterIndex, spec: JobSpec, reqs: list[PodReq]) -> GangRequest:
    eligs = [eligible(state, r, spec.tolerations) for r in reqs]
    union: dict[ClassKey, int] = {}
    for e in eligs:
        for penalty, key in e:
            union[key] = min(penalty, union.get(key, penalty))
    return GangRequest(spec, reqs, eligs, union, sum(r.need for r in reqs), sum(r.count for r in reqs))


def domain_free(state: ClusterIndex, keys: Iterable[ClassKey], level: TopologyLevel) -> dict[str, int]:
    """Free units per rack or block over the given classes."""
    totals: dict[str, int] = {}
    classes = state.classes
    for key in keys:
        for d, f in classes[key].dom_free[level].items():
            totals[d] = totals.get(d, 0) + f
    return totals


__all__ = [
    "BIG",
    "Eligibility",
    "Exclusion",
    "Free",
    "FreeResources",
    "GangRequest",
    "PodReq",
    "Selection",
    "Stage",
    "domain_free",
    "eligible",
    "excluded",
    "exclusions_for",
    "models_text",
    "placement_shape",
    "preference",
    "prepare",
    "refusing",
    "resolve",
    "selection_of",
    "trim",
    "unmatched",
]
