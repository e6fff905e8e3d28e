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

from shared.domain import (
    MILLI_GPU,
    GpuBinding,
    JobSpec,
    NodeAffinity,
    NodeSpec,
    PodSet,
    SharingMode,
    Toleration,
    TopologyLevel,
)

from .index import ClassKey, ClusterIndex
from .nodes import share_of, shared_room
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
    # A pod sharing a GPU (PodSet.shared): its compute share (milli-GPUs, 0: memory only), its GPU memory (MiB, 0:
    # none asked), the isolation it asks (None: any). `gpus` is 0 for it.
    shared: bool = False
    share: int = 0
    gmem: int = 0
    sharing: SharingMode | None = None

    @property
    def unit(self) -> int:
        """Units per pod: whole GPUs on plain nodes, one slice on MIG nodes, none for CPU-only pods and pods sharing
        a GPU (shared GPUs are not units)."""
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
    shares: tuple[tuple[int, int, int, int], ...] = ()  # (shared gpu, milli-GPUs, GPU memory MiB, pods)
    profs: tuple[tuple[int, int], ...] = ()  # mixed MIG: (profile index, slice mask)


def exclusions_for(placements: Iterable[Placement]) -> dict[str, Exclusion]:
    masks: dict[str, int] = {}
    slices: dict[str, dict[int, int]] = {}
    cpu: dict[str, int] = {}
    mem: dict[str, int] = {}
    shares: dict[str, dict[int, tuple[int, int, int]]] = {}
    for p in placements:
        for i, b in enumerate(p.bindings):
            m = masks.get(b.node, 0)
            for g in b.gpu_indices:
                m |= 1 << g
            masks[b.node] = m
            sl = slices.setdefault(b.node, {})
            if b.mig_slice is not None:
                sl[b.mig_slice[0]] = sl.get(b.mig_slice[0], 0) | (1 << b.mig_slice[1])
            sh = shares.setdefault(b.node, {})
            if b.shared_gpu is not None:
                used, gm, pods = sh.get(b.shared_gpu, (0, 0, 0))
                sh[b.shared_gpu] = (used + (b.share_milli or 0), gm + (b.gpu_memory_mib or 0), pods + 1)
            c, r = p.requests[i] if p.requests else (0, 0)
            cpu[b.node] = cpu.get(b.node, 0) + c
            mem[b.node] = mem.get(b.node, 0) + r
    # A MIG slice binding excludes the slice on a single-profile node and the profile's slice on a mixed one (the
    # stage applies whichever the node has).
    return {n: Exclusion(masks[n], tuple(sorted(slices[n].items())), cpu[n], mem[n],
                         tuple((g, *v) for g, v in sorted(shares[n].items())), tuple(sorted(slices[n].items())))
            for n in masks}


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
        gpus = 0 if ps.mig_profile or ps.shared else ps.gpus_per_pod
        reqs.append(PodReq(ps.name, ps.count, gpus, ps.mig_profile, ps.cpu_milli, ps.memory_mib, tuple(models),
                           ps.own_tolerations, selection_of(ps), ps.shared, ps.share_milli, ps.gpu_memory_mib or 0,
                           ps.gpu_sharing))
    return reqs


def placement_shape(spec: JobSpec) -> tuple[object, ...]:
    """Everything of a spec that placing it reads but its id (which placement only writes into its answer): the
    pod sets as `resolve` reads them (with their node selection), `min_members` (the gang size), topology,
    tolerations and datasets. Two specs of one shape get the same answer on the same state, but for the job id in it."""
    return (tuple((ps.name, ps.count, ps.gpus_per_pod, ps.gpu_models, ps.mig_profile, ps.cpu_milli, ps.memory_mib,
                   ps.own_tolerations, selection_of(ps), ps.gpu_fraction, ps.gpu_memory_mib, ps.gpu_sharing)
                  for ps in spec.pod_sets), spec.min_members, tuple(ps.min_count for ps in spec.pod_sets),
            spec.topology.required_level,
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


def at_pods(spec: JobSpec, reqs: list[PodReq], pods: int) -> list[PodReq]:
    """An elastic job's requests with `pods` pods in all (JobSpec.at_pods: each pod set keeps its floor)."""
    return [replace(r, count=ps.count) for r, ps in zip(reqs, spec.at_pods(pods).pod_sets, strict=True)]


def starting(spec: JobSpec, reqs: list[PodReq]) -> list[PodReq]:
    """The pods that must start: an elastic job's floors (min_count per pod set), else the first `gang_size`."""
    return at_pods(spec, reqs, spec.min_pods) if spec.elastic else trim(reqs, spec.gang_size)


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
                if c.mig != req.mig and req.mig not in c.profiles:
                    continue
            elif req.shared:
                # a pod sharing a GPU goes to nodes sharing theirs, the way it asks (isolation classes never mix)
                if c.sharing is None or (req.sharing is not None and c.sharing != req.sharing):
                    continue
            elif req.gpus > 0 and c.mig is not None:
                continue  # whole-GPU pods never land on a partitioned node
            if any(not any(t.tolerates(taint) for t in tolerations) for taint in c.hard):
                continue
            penalty = sum(1 for taint in c.soft if not any(t.tolerates(taint) for t in tolerations))
            out.append((penalty, key))
        return tuple(sorted(out, key=lambda pk: (pk[0], repr(pk[1]))))

    return state.spec_memo(("eligible", req.models, req.mig, req.gpus > 0, req.shared, req.sharing, tolerations),
                           compute)


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
    sh_share: list[int] | None
    sh_mem: list[int] | None
    sh_pods: list[int] | None
    prof_free: dict[str, int] | None


class Free:
    """A node's free resources as a scratch copy (a `FreeResources`): what is left on the stage, or what the
    reservation search's replay has freed. The shared GPUs' lists count what is used there (as IndexedNode's)."""

    __slots__ = ("cpu", "free_mask", "mem", "prof_free", "sh_mem", "sh_pods", "sh_share", "slice_free")

    def __init__(self, free_mask: int, slice_free: list[int] | None, cpu: int, mem: int,
                 sh_share: list[int] | None = None, sh_mem: list[int] | None = None,
                 sh_pods: list[int] | None = None, prof_free: dict[str, int] | None = None):
        self.free_mask = free_mask
        self.slice_free = slice_free
        self.cpu = cpu
        self.mem = mem
        self.sh_share = sh_share
        self.sh_mem = sh_mem
        self.sh_pods = sh_pods
        self.prof_free = prof_free

    @classmethod
    def of(cls, n: FreeResources) -> Free:
        """A scratch copy of `n`'s free resources."""
        if n.sh_share is None and n.prof_free is None:
            return cls(n.free_mask, list(n.slice_free) if n.slice_free is not None else None, n.cpu, n.mem)
        return cls(n.free_mask, list(n.slice_free) if n.slice_free is not None else None, n.cpu, n.mem,
                   list(n.sh_share) if n.sh_share is not None else None,
                   list(n.sh_mem) if n.sh_mem is not None else None,
                   list(n.sh_pods) if n.sh_pods is not None else None,
                   dict(n.prof_free) if n.prof_free is not None else None)


def shared_fits(spec: NodeSpec, s: FreeResources, req: PodReq, opened_only: bool) -> int:
    """How many pods of `req` (sharing a GPU) the shared GPUs of a node with free resources `s` still hold;
    `opened_only`: on GPUs some pod shares already (none opened)."""
    if s.sh_share is None or s.sh_mem is None or s.sh_pods is None:
        return 0
    share = share_of(spec, req.share, req.gmem)
    k = 0
    for g in range(len(s.sh_share)):
        if opened_only and not s.sh_pods[g]:
            continue
        k += shared_room(spec, share, req.gmem, s.sh_share[g], s.sh_mem[g], s.sh_pods[g])
    return k


def shared_capacity(spec: NodeSpec, req: PodReq) -> int:
    """How many pods of `req` (sharing a GPU) the node's shared GPUs hold when nothing else is there."""
    share = share_of(spec, req.share, req.gmem)
    return spec.shared_gpus * shared_room(spec, share, req.gmem, 0, 0, 0)


def pick_shared_gpu(spec: NodeSpec, s: FreeResources, share: int, gmem: int) -> int | None:
    """The shared GPU one more pod goes to: a GPU already shared before an idle one (packing), the one left with
    the least compute after it first (best fit), the lowest index on ties; None when none holds it."""
    best: tuple[int, int, int] | None = None
    assert s.sh_share is not None and s.sh_mem is not None and s.sh_pods is not None
    for g in range(len(s.sh_share)):
        if shared_room(spec, share, gmem, s.sh_share[g], s.sh_mem[g], s.sh_pods[g]) <= 0:
            continue
        key = (0 if s.sh_pods[g] else 1, MILLI_GPU - s.sh_share[g] - share, g)
        if best is None or key < best:
            best = key
    return best[2] if best is not None else None


class Stage:
    """Scratch copy of the free resources of the nodes a placement touches; the index is never written.
    `nodes` defaults to the index's own records; the reservation search passes its private view of them."""

    __slots__ = ("barred", "exclude", "nodes", "opened_only", "refusals", "slots", "state")

    def __init__(self, state: ClusterIndex, exclude: Mapping[str, Exclusion] | None,
                 nodes: Mapping[str, FreeResources] | None = None):
        self.state = state
        self.exclude = exclude
        self.slots: dict[str, Free] = {}
        self.nodes: Mapping[str, FreeResources] = state.indexed_nodes if nodes is None else nodes
        self.barred: dict[int, frozenset[str]] = {}  # id(req) -> `excluded(state, req)`, for the reqs staged here
        self.refusals = bool(state.refusing_nodes)  # some node refused a pod shape: every req is checked
        # While True, pods sharing a GPU go only to shared GPUs already in use (the placer's first pass: pack them
        # before a GPU is opened to sharing).
        self.opened_only = False

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
            s = Free.of(n)
            e = self.exclude.get(name) if self.exclude else None
            if e is not None:
                s.free_mask &= ~e.mask
                if s.slice_free is not None:
                    for g, smask in e.slices:
                        if g < len(s.slice_free):
                            s.slice_free[g] &= ~smask
                if s.sh_share is not None and s.sh_mem is not None and s.sh_pods is not None:
                    for g, share, gmem, pods in e.shares:
                        if g < len(s.sh_share):
                            s.sh_share[g] += share
                            s.sh_mem[g] += gmem
                            s.sh_pods[g] += pods
                if s.prof_free is not None:
                    names = sorted(s.prof_free)
                    for row, smask in e.profs:
                        if row < len(names):
                            s.prof_free[names[row]] &= ~smask
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
            if s.prof_free is not None:
                k = s.prof_free.get(req.mig, 0).bit_count()
            else:
                k = sum(x.bit_count() for x in s.slice_free or ())
        elif req.shared:
            k = shared_fits(self.state.indexed_nodes[name].spec, s, req, self.opened_only)
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
            elif req.mig and s.prof_free is not None:
                names = sorted(s.prof_free)
                free = s.prof_free[req.mig]
                low = free & -free
                s.prof_free[req.mig] = free ^ low
                out.append(GpuBinding(pod=pod, node=name, mig_slice=(names.index(req.mig), low.bit_length() - 1)))
            elif req.shared and s.sh_share is not None and s.sh_mem is not None and s.sh_pods is not None:
                spec = self.state.indexed_nodes[name].spec
                share = share_of(spec, req.share, req.gmem)
                g = pick_shared_gpu(spec, s, share, req.gmem)
                assert g is not None and spec.sharing is not None  # `fits` counted room for it
                s.sh_share[g] += share
                s.sh_mem[g] += req.gmem
                s.sh_pods[g] += 1
                out.append(GpuBinding(pod=pod, node=name, shared_gpu=g, share_milli=share,
                                      gpu_memory_mib=req.gmem or None, sharing=spec.sharing.mode))
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
    "at_pods",
    "domain_free",
    "eligible",
    "excluded",
    "exclusions_for",
    "models_text",
    "pick_shared_gpu",
    "placement_shape",
    "preference",
    "prepare",
    "refusing",
    "resolve",
    "selection_of",
    "shared_capacity",
    "shared_fits",
    "starting",
    "trim",
    "unmatched",
]
