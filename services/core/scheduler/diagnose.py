"""Why a gang cannot be placed: a machine reason and a human message that names the numbers.

Only runs on the failure path, checking from the most fundamental cause to the most circumstantial:
model/profile exists -> taints tolerated -> node labels match (nodeSelector, required node affinity) -> nodes
ready -> enough free units -> pod shapes fit on nodes -> CPU/memory -> topology -> fragmentation. The first
failing check is the reason. Past the label check, only the nodes whose labels match are counted; nodes that
refused pods of the shape (`NodeSpec.refused`) are not counted either, and when they are why it does not fit, the
reason is PlacementRefused, naming them and what they said.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from shared.domain import JobSpec, Taint, TopologyLevel

from .index import ClusterIndex, IndexedNode, NodeClass
from .staging import (
    Eligibility,
    Exclusion,
    GangRequest,
    PodReq,
    Stage,
    domain_free,
    excluded,
    shared_fits,
    unmatched,
)
from .types import Reason, Unplaceable


def _models(models: tuple[str, ...]) -> str:
    return "/".join(models) if models else "any model"


def _what(req: PodReq) -> str:
    if req.mig:
        return f"{req.need}×{req.mig} MIG slices ({_models(req.models)})"
    if req.gpus:
        return f"{req.need}×{_models(req.models)}" if req.models else f"{req.need} GPUs"
    if req.shared:
        return f"{req.count} pod(s) sharing a GPU ({_share(req)}, {_models(req.models)})"
    return f"{req.count} CPU-only pod(s)"


def _share(req: PodReq) -> str:
    parts = [f"{req.share / 1000:g} GPU"] if req.share else []
    if req.gmem:
        parts.append(f"{req.gmem} MiB GPU memory")
    parts.append(f"{req.sharing.value} only" if req.sharing is not None else "any isolation")
    return ", ".join(parts)


def _inventory(state: ClusterIndex) -> str:
    by_model: dict[str, int] = {}
    nodes = state.indexed_nodes
    for c in state.classes.values():
        by_model[c.model] = by_model.get(c.model, 0) + sum(nodes[n].gpus for n in _class_nodes(state, c))
    return ", ".join(f"{m} ({g} GPUs)" for m, g in sorted(by_model.items())) or "no nodes"


def _class_nodes(state: ClusterIndex, c: NodeClass) -> list[str]:
    out: list[str] = []
    for names in state.domain_members(c.key, TopologyLevel.RACK).values():
        out.extend(names)
    return out


def _taint(t: Taint) -> str:
    key, value, effect = t.key, t.value, t.effect.value
    return f"{key}={value}:{effect}" if value else f"{key}:{effect}"


def _shaped(state: ClusterIndex, req: PodReq, jid: str) -> list[NodeClass] | Unplaceable:
    """The node classes whose GPUs have the pod set's shape (its models; MIG slices of its profile, shared GPUs of
    its isolation, or whole GPUs), or why none has."""
    classes = sorted(state.classes.values(), key=lambda c: repr(c.key))
    of_model = [c for c in classes if not req.models or c.model in req.models]
    if req.mig:
        shaped = [c for c in of_model if c.mig == req.mig or req.mig in c.profiles]
        if not shaped:
            profiles = sorted({c.mig for c in classes if c.mig} | {p for c in classes for p in c.profiles})
            have = f"partitioned nodes offer {', '.join(profiles)}" if profiles else "no node is MIG-partitioned"
            return Unplaceable(jid, Reason.NO_MIG_SLICES,
                               f"pod set {req.pod_set} needs {req.mig} MIG slices on {_models(req.models)}; {have}")
    elif req.shared:
        shaped = [c for c in of_model if c.sharing is not None and (req.sharing is None or c.sharing == req.sharing)]
        if not shaped:
            modes = sorted({c.sharing.value for c in of_model if c.sharing is not None})
            which = f"{_models(req.models)} " if req.models else ""
            have = (f"the {which}nodes share GPUs by {', '.join(modes)} only" if modes
                    else f"no {which}node shares its GPUs")
            return Unplaceable(jid, Reason.NO_SHARED_GPU, f"pod set {req.pod_set} needs part of a GPU "
                               f"({_share(req)}); {have}")
    elif req.gpus:
        shaped = [c for c in of_model if c.mig is None]
        if not shaped:
            if of_model:
                return Unplaceable(jid, Reason.NO_GPU_MODEL,
                                   f"pod set {req.pod_set} needs whole {_models(req.models)} GPUs but every such "
                                   "node is MIG-partitioned")
            wanted = _models(req.models) if req.models else "whole GPUs"
            return Unplaceable(jid, Reason.NO_GPU_MODEL,
                               f"pod set {req.pod_set} needs {wanted}; the cluster has {_inventory(state)}")
    else:
        shaped = of_model
        if not shaped:
            where = f"a {_models(req.models)} node" if req.models else "a node"
            return Unplaceable(jid, Reason.NO_GPU_MODEL,
                               f"pod set {req.pod_set} needs {where}; the cluster has {_inventory(state)}")
    return shaped


def _check_pod_set(state: ClusterIndex, spec: JobSpec, req: PodReq, elig: Eligibility,
                   exclude: Mapping[str, Exclusion] | None) -> Unplaceable | None:
    jid = spec.job_id
    shaped = _shaped(state, req, jid)
    if isinstance(shaped, Unplaceable):
        return shaped
    keys = {k for _, k in elig}
    tolerated = [c for c in shaped if c.key in keys]
    if not tolerated:
        tolerations = spec.tolerations + req.tolerations
        taints = sorted({_taint(t) for c in shaped for t in c.hard
                         if not any(tol.tolerates(t) for tol in tolerations)})
        return Unplaceable(jid, Reason.UNTOLERATED,
                           f"every node with {_models(req.models)} carries a taint the job does not tolerate "
                           f"({', '.join(taints)})")
    barred = excluded(state, req)
    if barred:
        return _check_selected(state, spec, req, shaped, tolerated, barred, exclude)
    if sum(c.ready_nodes for c in tolerated) == 0:
        total = sum(c.total_nodes for c in tolerated)
        by_health: dict[str, int] = {}
        for c in tolerated:
            for name in _class_nodes(state, c):
                health = state.indexed_nodes[name].spec.health.value
                by_health[health] = by_health.get(health, 0) + 1
        states = ", ".join(f"{n} {h}" for h, n in sorted(by_health.items()))
        hint = " (degraded = a GPU fault found by the health checks)" if "degraded" in by_health else ""
        return Unplaceable(jid, Reason.NO_READY_NODES,
                           f"none of the {total} node(s) with {_models(req.models)} usable by the job is ready: "
                           f"{states}{hint}")
    if req.shared:
        nodes = state.indexed_nodes
        room = sum(shared_fits(nodes[name].spec, nodes[name], req, False) for c in tolerated
                   for name in _class_nodes(state, c) if nodes[name].ready)
        if room < req.count:
            return Unplaceable(jid, Reason.NO_SHARED_GPU, f"needs {_what(req)}; the shared GPUs have room for "
                               f"{room} such pod(s) (compute, GPU memory and pods per GPU left)")
    free = sum(c.free for c in tolerated)
    cap = sum(c.cap for c in tolerated)
    if req.unit and free < req.need:
        reason = Reason.NO_MIG_SLICES if req.mig else Reason.INSUFFICIENT_GPUS
        ready = (state.indexed_nodes[name] for c in tolerated for name in _class_nodes(state, c))
        return Unplaceable(jid, reason, f"needs {_what(req)}; {free} free of {cap}{_held_note(ready)}")
    if req.gpus > 1:
        pods = sum(len(ranks) * (b // req.gpus) for c in tolerated for b, ranks in c.buckets.items())
        if pods < req.count:
            largest = max((b for c in tolerated for b in c.buckets), default=0)
            kind = f"{_models(req.models)} GPUs" if req.models else "GPUs"
            return Unplaceable(jid, Reason.INSUFFICIENT_GPUS,
                               f"needs {req.count} pod(s) × {req.gpus} {kind}, each pod on one node; free GPUs "
                               f"({free}) allow only {pods} such pod(s), largest free on a node is {largest}")
    order = state.rank_order
    return _check_cpu_memory(state, spec, req, (order[r] for c in tolerated for b, ranks in c.buckets.items()
                                                if b >= req.unit for r in ranks), exclude)


def _check_cpu_memory(state: ClusterIndex, spec: JobSpec, req: PodReq, names: Iterable[str],
                      exclude: Mapping[str, Exclusion] | None) -> Unplaceable | None:
    """CPU and memory (and exclusions): count the pods that really fit on `names` (the ready nodes with room for
    one pod's units), node by node."""
    stage = Stage(state, exclude)
    fit = 0
    for name in names:
        fit += stage.fits(name, req)
        if fit >= req.count:
            return None
    if exclude:
        return None  # the reserved capacity is the obstacle: the caller names the reservation
    return Unplaceable(spec.job_id, Reason.INSUFFICIENT_CPU_MEMORY,
                       f"needs {req.count} pod(s) of {req.cpu}m CPU and {req.mem} MiB memory with "
                       f"{_what(req)}; the nodes with free GPUs have CPU/memory for only {fit} pod(s)")


def _check_selected(state: ClusterIndex, spec: JobSpec, req: PodReq, shaped: list[NodeClass],
                    tolerated: list[NodeClass], barred: frozenset[str], exclude: Mapping[str, Exclusion] | None
                    ) -> Unplaceable | None:
    """The checks past the taints for a pod set some of whose nodes are barred (the class aggregates count every
    node of a class): by label (its selection), counted on the nodes it matches; and by refusal (nodes that turned
    a pod of its shape away), which, when they are why it does not fit, is the reason (PlacementRefused)."""
    jid = spec.job_id
    nodes = state.indexed_nodes
    names = sorted((name for c in tolerated for name in _class_nodes(state, c)), key=lambda n: nodes[n].rank)
    off = unmatched(state, req)
    matching = [nodes[name] for name in names if name not in off]
    wanted = req.select.describe() if req.select is not None and off else ""
    if not matching:
        assert req.select is not None  # nothing is unmatched without a selection
        tolerations = spec.tolerations + req.tolerations
        taints = sorted({_taint(t) for c in shaped if c not in tolerated
                         for name in _class_nodes(state, c) if name not in off
                         for t in c.hard if not any(tol.tolerates(t) for tol in tolerations)})
        if taints:  # the nodes it selects exist, but their taints keep it off
            return Unplaceable(jid, Reason.UNTOLERATED,
                               f"pod set {req.pod_set}: the nodes matching {wanted} carry a taint the job does not "
                               f"tolerate ({', '.join(taints)})")
        return Unplaceable(jid, Reason.NO_MATCHING_NODE,
                           f"pod set {req.pod_set} asks {wanted}: none of the {len(names)} node(s) with "
                           f"{_models(req.models)} it may use matches{_seen(state, names, req.select.keys())}")
    ready = [n for n in matching if n.ready]
    if not ready:
        by_health: dict[str, int] = {}
        for n in matching:
            by_health[n.spec.health.value] = by_health.get(n.spec.health.value, 0) + 1
        states = ", ".join(f"{k} {h}" for h, k in sorted(by_health.items()))
        which = f"matching {wanted}" if wanted else f"with {_models(req.models)} usable by the job"
        return Unplaceable(jid, Reason.NO_READY_NODES,
                           f"none of the {len(matching)} node(s) {which} is ready: {states}")
    refused = [n for n in ready if n.name in barred]
    usable = [n for n in ready if n.name not in barred]
    found = _check_counts(state, spec, req, usable, wanted, bool(refused), exclude)
    if found is None or not refused:
        return found
    return Unplaceable(jid, Reason.PLACEMENT_REFUSED, f"{found.message}; {_refusals(refused, req)}")


def _check_counts(state: ClusterIndex, spec: JobSpec, req: PodReq, usable: list[IndexedNode], wanted: str,
                  refusals: bool, exclude: Mapping[str, Exclusion] | None) -> Unplaceable | None:
    """Free units, pod-sized pieces, CPU and memory on the `usable` ready nodes."""
    jid = spec.job_id
    free = sum(n.units for n in usable)
    cap = sum(n.cap_units for n in usable)
    where = f"on the {len(usable)} ready node(s)" + (f" matching {wanted}" if wanted else "") + (
        " that did not refuse it" if refusals else "")
    if req.unit and free < req.need:
        reason = Reason.NO_MIG_SLICES if req.mig else Reason.INSUFFICIENT_GPUS
        return Unplaceable(jid, reason, f"needs {_what(req)}; {free} free of {cap} {where}{_held_note(usable)}")
    if req.shared:
        room = sum(shared_fits(n.spec, n, req, False) for n in usable)
        if room < req.count:
            return Unplaceable(jid, Reason.NO_SHARED_GPU, f"needs {_what(req)}; the shared GPUs {where} have room "
                               f"for {room} such pod(s)")
    if req.gpus > 1:
        pods = sum(n.units // req.gpus for n in usable)
        if pods < req.count:
            largest = max((n.units for n in usable), default=0)
            return Unplaceable(jid, Reason.INSUFFICIENT_GPUS,
                               f"needs {req.count} pod(s) × {req.gpus} GPUs, each pod on one node; free GPUs "
                               f"({free}) {where} allow only {pods} such pod(s), largest free on a node is "
                               f"{largest}")
    return _check_cpu_memory(state, spec, req, _roomy(usable, req), exclude)


def _refusals(refused: list[IndexedNode], req: PodReq, limit: int = 3) -> str:
    """"n1 refused a pod of 8 GPU(s), 4000m CPU, 8192 MiB (OutOfnvidia.com/gpu: …)"; such nodes wait for their
    usage to change."""
    parts = []
    for n in refused[:limit]:
        r = n.spec.refuses(req.gpus, req.mig, req.cpu, req.mem)
        if r is not None:
            parts.append(f"{n.name} refused a pod of {r.shape.describe()} ({r.reason}: {r.message})"
                         if r.message else f"{n.name} refused a pod of {r.shape.describe()} ({r.reason})")
    more = f" and {len(refused) - limit} more node(s)" if len(refused) > limit else ""
    return (f"{'; '.join(parts)}{more}: no such pod goes there until what runs there changes" if parts
            else f"{len(refused)} node(s) refused such pods")


def _held_note(nodes: Iterable[IndexedNode]) -> str:
    """" (8 held by pods gpuq does not manage)" when the ready nodes counted hold such units, else ""."""
    held = sum(n.held_units for n in nodes if n.ready)
    return f" ({held} held by pods gpuq does not manage)" if held else ""


def _seen(state: ClusterIndex, names: list[str], keys: tuple[str, ...], limit: int = 8) -> str:
    """What those nodes carry of the selected keys: "; their labels: pool=a100, pool=h100, zone absent"."""
    nodes = state.indexed_nodes
    parts = []
    for key in keys:
        values = sorted({nodes[n].spec.labels[key] for n in names if key in nodes[n].spec.labels})
        shown = [f"{key}={v}" for v in values[:limit]] + (["…"] if len(values) > limit else [])
        if any(key not in nodes[n].spec.labels for n in names):
            shown.append(f"{key} absent")
        parts.extend(shown)
    return f"; their labels: {', '.join(parts)}" if parts and names else ""


def _roomy(ready: Iterable[IndexedNode], req: PodReq) -> Iterator[str]:
    return (n.name for n in ready if n.units >= req.unit)


def diagnose(state: ClusterIndex, spec: JobSpec, job: GangRequest, exclude: Mapping[str, Exclusion] | None
             ) -> Unplaceable:
    jid = spec.job_id
    for req, elig in zip(job.reqs, job.eligs, strict=True):
        found = _check_pod_set(state, spec, req, elig, exclude)
        if found is not None:
            return found
    models = tuple(sorted({m for r in job.reqs for m in r.models}))
    units = "slices" if all(r.mig for r in job.reqs) else "GPUs"
    if units != "GPUs":
        what = f"{job.need} MIG slices"
    else:
        what = f"{job.need}×{_models(models)}" if models else f"{job.need} GPUs"
    classes = state.classes
    free_total = sum(classes[k].free for k in job.union)
    if free_total < job.need:
        return Unplaceable(jid, Reason.INSUFFICIENT_GPUS,
                           f"needs {what} in all; {free_total} free on the nodes the job may use")
    level = spec.topology.required_level
    if level is not None:
        if level is TopologyLevel.NODE:
            best = max((b for k in job.union for b in classes[k].buckets), default=0)
        else:
            best = max(domain_free(state, job.union, level).values(), default=0)
        if best < job.need:
            return Unplaceable(jid, Reason.TOPOLOGY_UNSATISFIABLE,
                               f"needs {what} in one {level.value}; largest free {level.value} has {best}")
        return Unplaceable(jid, Reason.TOPOLOGY_UNSATISFIABLE,
                           f"needs {what} in one {level.value}; the {level.value}s with {job.need}+ free "
                           f"{units} cannot host the pods (per-node GPU, CPU or memory shapes)")
    return Unplaceable(jid, Reason.INSUFFICIENT_GPUS,
                       f"needs {what} for {job.pods} pods at once; {free_total} {units} are free but "
                       "fragmented across nodes that cannot host the pods together")
