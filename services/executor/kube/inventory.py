"""Nodes -> NodeInventory / NodeChanged, announced only when gpuq's view of a node changes.

All publishing goes through `publish_all` (a whole list: the first sync and resyncs) and `publish_node` (one watch
event), so that chunked or per-node inventories change this module only. Both return the nodes that just became
unusable (failed or removed): their jobs must be requeued or failed.

With the DCGM source on, nodes are announced with its verdicts applied (`degraded`: a ready node with a GPU fault
is announced degraded), and `executor.kube_nodes` holds what was last announced, verdict included (the source
records its own NodeChanged there through `record`). So a Node update (a label, a cordon and uncordon, a relist)
never announces a degraded node ready again: only the source's clean polls do.

Each node is announced with what the pods gpuq does not manage hold there (`NodeSpec.held`, from the executor's
informer of every bound pod: core/usage.py), so that a change of those pods announces the node again; and with the
pod shapes it refused (`NodeSpec.refused`, added by `refuse`), kept while the node and what its pods hold are
unchanged, dropped (the node announced again) when they change."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from services.core.kube import names as n
from services.core.kube.dra import Device, with_devices
from services.core.kube.nodes import node_spec, selected
from services.core.kube.usage import NodeLoads, still_refused, with_refusal
from services.executor.dcgm import with_health
from shared.config import KubernetesSource
from shared.domain import NO_USAGE, NodeHealth, NodeSpec, PlacementRefusal, PodShape
from shared.events import INVENTORY_CHUNK, NodeChanged, NodeInventory
from shared.service import Tx

log = logging.getLogger("gpuq.executor.kube")
SOURCE = "kubernetes"

Verdicts = Mapping[str, tuple[str, str]]  # node -> (reason, message) of the DCGM source's degraded nodes
Devices = Mapping[str, tuple[Device, ...]]  # node -> its DRA GPU devices (core/kube/dra.py)
NO_VERDICTS: Verdicts = {}


MAX_REFUSAL_MESSAGE = 500  # characters of kube-scheduler's or the kubelet's message kept with a refusal

# What the nodes of one NodeInventory part may weigh: half of NATS's default max_payload (1 MiB), so the envelope
# fits beside them. A node carries all its labels (jobs select on them): tens of them on a real node.
MAX_PART_BYTES = 512 * 1024


def _chunk(texts: list[str]) -> int:
    """Nodes per part: INVENTORY_CHUNK, fewer when the largest node's JSON would take a part past MAX_PART_BYTES."""
    largest = max((len(t) for t in texts), default=1)
    return max(1, min(INVENTORY_CHUNK, MAX_PART_BYTES // largest))


def _map(obj: dict[str, Any], cfg: KubernetesSource, degraded: Verdicts = NO_VERDICTS, *,
         quiet: bool = False, loads: NodeLoads | None = None, devices: Devices | None = None) -> NodeSpec | None:
    if not selected(obj, cfg):
        return None
    try:
        spec = node_spec(obj, cfg)
    except ValueError as exc:  # a node we cannot read is not offered to the scheduler; say so (once, on its event)
        if not quiet:
            log.error("ignoring node: %s", exc)
        return None
    if devices:  # DRA: a node whose GPUs are the ResourceSlices' devices
        spec = with_devices(spec, devices.get(spec.name, ()), cfg)
    if loads is not None:  # what the pods gpuq does not manage hold there
        held = loads.held(spec.name, spec.mig.profile if spec.mig else None)
        if spec.sharing is not None and held.gpus > spec.gpus:  # replicas of shared GPUs: at most every GPU
            held = held.model_copy(update={"gpus": spec.gpus})
        spec = spec.model_copy(update={"held": held})
        if spec.mig_profiles:  # a mixed-strategy node: the slices of each profile others hold are not gpuq's
            slices = loads.held_slices(spec.name)
            spec = spec.model_copy(update={"mig_profiles": {p: max(0, n - slices.get(p, 0))
                                                            for p, n in spec.mig_profiles.items()}})
    return with_health([spec], degraded)[0]


def _refusals_kept(spec: NodeSpec, before: NodeSpec | None, loads: NodeLoads | None) -> NodeSpec:
    """`spec` with the refusals of what was announced `before` that still hold: the node itself is the same
    (capacity, labels, taints, health) and what its pods hold (the refused job's left out) is what it was."""
    if before is None or not before.refused or loads is None:
        return spec
    if _bare(before) != _bare(spec):
        return spec  # the node changed: it is tried again for every shape
    profile = spec.mig.profile if spec.mig else None
    kept = still_refused(before.refused, lambda job_id: loads.usage(spec.name, profile, but=n.job_label(job_id)))
    return spec.model_copy(update={"refused": kept}) if kept else spec


def _bare(spec: NodeSpec) -> NodeSpec:
    return spec.model_copy(update={"held": NO_USAGE, "refused": ()})


async def refuse(tx: Tx, obj: dict[str, Any], cfg: KubernetesSource, *, job_id: str, shape: PodShape, reason: str,
                 message: str, loads: NodeLoads, degraded: Verdicts = NO_VERDICTS, devices: Devices | None = None
                 ) -> NodeSpec | None:
    """The node `obj` refused a pod of `job_id` gpuq placed there: announce it with the refusal (NodeChanged, reason
    PlacementRefused) and what its other pods hold now, so that the scheduler places no such pod there until that
    changes. None when the node is not one gpuq announces."""
    name = (obj.get("metadata") or {})["name"]
    known = await tx.conn.fetchval("SELECT spec FROM executor.kube_nodes WHERE name = $1", name)
    before = NodeSpec.model_validate_json(known) if known else None
    current = _map(obj, cfg, degraded, loads=loads, devices=devices)
    if current is None:
        return None
    current = _refusals_kept(current, before, loads)
    usage = loads.usage(name, current.mig.profile if current.mig else None, but=n.job_label(job_id))
    refusal = PlacementRefusal(shape=shape, reason=reason, message=message[:MAX_REFUSAL_MESSAGE], job_id=job_id,
                               usage=usage)
    after = current.model_copy(update={"refused": with_refusal(current.refused, refusal)})
    await tx.emit(NodeChanged(node=after, change="updated" if before is not None else "added",
                              reason="PlacementRefused", message=f"{reason}: {message}" if message else reason))
    await _store(tx, after)
    return after


def specs(objects: Iterable[dict[str, Any]], cfg: KubernetesSource, loads: NodeLoads | None = None,
          devices: Devices | None = None) -> dict[str, NodeSpec]:
    """gpuq's nodes as the cluster reports them (without the DCGM verdicts), by name."""
    return {spec.name: spec for obj in objects
            if (spec := _map(obj, cfg, quiet=True, loads=loads, devices=devices)) is not None}


async def _known(tx: Tx) -> dict[str, NodeSpec]:
    rows = await tx.conn.fetch("SELECT name, spec FROM executor.kube_nodes ORDER BY name")
    return {r["name"]: NodeSpec.model_validate_json(r["spec"]) for r in rows}


async def record(tx: Tx, node: NodeSpec) -> list[str]:
    """Remember `node` as the DCGM source has just announced it (its NodeChanged). The source announces the node as
    the informer's cache has it, which may be ahead of this module's last announcement (a node gone NotReady whose
    watch event is still queued): returned, like the publishers', when that made it unusable."""
    known = await tx.conn.fetchval("SELECT spec FROM executor.kube_nodes WHERE name = $1", node.name)
    await _store(tx, node)
    return [node.name] if _unusable(NodeSpec.model_validate_json(known) if known else None, node) else []


async def _store(tx: Tx, node: NodeSpec) -> None:
    await tx.conn.execute("INSERT INTO executor.kube_nodes(name, spec) VALUES ($1, $2) "
                          "ON CONFLICT (name) DO UPDATE SET spec = excluded.spec", node.name, node.model_dump_json())


def _unusable(before: NodeSpec | None, after: NodeSpec | None) -> bool:
    was_up = before is not None and before.health is not NodeHealth.FAILED
    return was_up and (after is None or after.health is NodeHealth.FAILED)


async def publish_all(tx: Tx, objects: Iterable[dict[str, Any]], cfg: KubernetesSource, *, first: bool,
                      degraded: Verdicts = NO_VERDICTS, loads: NodeLoads | None = None,
                      devices: Devices | None = None) -> list[str]:
    """The whole node list. On this process's first sync, a NodeInventory of every node (when anything differs
    from what was announced before); afterwards, a NodeChanged per difference. Nodes gone are removed.
    `loads`: the pods bound to the nodes, whose holdings outside gpuq each node is announced with."""
    known = await _known(tx)
    current = {spec.name: _refusals_kept(spec, known.get(spec.name), loads)
               for obj in objects if (spec := _map(obj, cfg, degraded, loads=loads, devices=devices)) is not None}
    changed = sorted(name for name in current if known.get(name) != current[name])
    removed = sorted(known.keys() - current.keys())
    if first and (changed or not known):
        ordered = [current[k] for k in sorted(current)]
        texts = [n.model_dump_json() for n in ordered]
        digest = hashlib.sha256("".join(texts).encode()).hexdigest()[:16]
        for part in NodeInventory.chunked(ordered, source=SOURCE, announcement=f"{SOURCE}-{digest}",
                                          chunk=_chunk(texts)):
            await tx.emit(part)
    else:
        for name in changed:
            await tx.emit(NodeChanged(node=current[name], change="updated" if name in known else "added"))
    for name in changed:
        await _store(tx, current[name])
    for name in removed:
        await tx.emit(NodeChanged(node=known[name], change="removed"))
        await tx.conn.execute("DELETE FROM executor.kube_nodes WHERE name = $1", name)
    return sorted(name for name in set(changed) | set(removed) if _unusable(known.get(name), current.get(name)))


async def publish_node(tx: Tx, obj: dict[str, Any], cfg: KubernetesSource, *, deleted: bool,
                       degraded: Verdicts = NO_VERDICTS, loads: NodeLoads | None = None,
                       devices: Devices | None = None) -> list[str]:
    """One node's watch event (or a change of what its pods hold): NodeChanged when gpuq's view of it changed."""
    name = (obj.get("metadata") or {})["name"]
    known = await tx.conn.fetchval("SELECT spec FROM executor.kube_nodes WHERE name = $1", name)
    before = NodeSpec.model_validate_json(known) if known else None
    after = None if deleted else _map(obj, cfg, degraded, loads=loads, devices=devices)
    if after is not None:
        after = _refusals_kept(after, before, loads)
    if after == before:
        return []
    if after is None:
        assert before is not None
        await tx.emit(NodeChanged(node=before, change="removed"))
        await tx.conn.execute("DELETE FROM executor.kube_nodes WHERE name = $1", name)
    else:
        await tx.emit(NodeChanged(node=after, change="updated" if before is not None else "added"))
        await _store(tx, after)
    return [name] if _unusable(before, after) else []
