"""The cluster's nodes as the scheduler sees them: announced (NodeInventory/NodeChanged) from the node informer with
what every bound pod holds there, gpuq's or not, and the DCGM source's verdicts; a failed or removed node's jobs
are requeued or failed."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from lightkube import operators

from services.core.kube.dra import Device, node_devices
from services.core.kube.usage import TERMINAL_PHASES, NodeLoads, pod_load
from services.executor.dcgm import degraded_nodes
from services.executor.kube import inventory
from services.executor.kube.client import NODE, POD, KubeApi
from services.executor.kube.devices import RESOURCE_SLICE, serves_dra
from services.executor.kube.informer import Informer, key_of
from services.executor.kube.leadership import Seat
from services.executor.kube.outcomes import Outcomes
from services.executor.kube.records import ACTIVE
from shared.config import KubernetesSource
from shared.domain import JobSpec, NodeSpec
from shared.events import ExitReason, PreemptionReason
from shared.service import Tx

log = logging.getLogger("gpuq.executor.kube")


class NodeWatch:
    def __init__(self, api: KubeApi, cfg: KubernetesSource, seat: Seat, outcomes: Outcomes, *, degrades: bool):
        self.api = api
        self.cfg = cfg
        self.seat = seat
        self.outcomes = outcomes
        self.degrades = degrades  # the DCGM source runs, and may degrade nodes
        # Told of every node seen (a spot interruption notice; services/executor/kube/interruptions.py)
        self.on_notice: Callable[[Tx, dict[str, Any]], Awaitable[None]] | None = None
        self.informer = Informer(api, NODE, self.on_node, on_synced=self.on_nodes_synced, resync_s=cfg.resync_s,
                                 name="nodes")
        # Every pod bound to a node and not finished, in every namespace, gpuq's or not: what the nodes hold.
        self.loads = NodeLoads()
        self.bound_pod_informer = Informer(
            api, POD, self.on_bound_pod, fields={"spec.nodeName": operators.not_equal(""),
                                                 "status.phase": operators.not_in(sorted(TERMINAL_PHASES))},
            everywhere=True, resync_s=cfg.resync_s, name="bound-pods")
        self.announced = False  # the first list has been announced whole
        # DRA (where the API serves resource.k8s.io/v1): each node's GPU devices from the ResourceSlices.
        self.devices: dict[str, tuple[Device, ...]] = {}
        self.slice_informer = Informer(api, RESOURCE_SLICE, self.on_slice, on_synced=self.on_slices_synced,
                                       resync_s=cfg.resync_s, name="resourceslices")

    async def watch_devices(self, wait_s: float) -> list[asyncio.Task[None]]:
        """DRA: the ResourceSlices' devices, listed (up to `wait_s`) before the nodes are first announced; no task
        where the API does not serve them."""
        if not await serves_dra(self.api):
            return []
        task = asyncio.create_task(self.slice_informer.run(), name="kube-resourceslices")
        try:
            await asyncio.wait_for(self.slice_informer.synced.wait(), wait_s)
        except TimeoutError:
            log.warning("the ResourceSlices are not listed after %.0f s: nodes are announced without their DRA "
                        "devices until they are", wait_s)
        return [task]

    async def on_slices_synced(self, cache: dict[str, dict[str, Any]]) -> None:
        await self._devices_changed(cache)

    async def on_slice(self, kind: str, obj: dict[str, Any]) -> None:
        await self._devices_changed(self.slice_informer.cache)

    async def _devices_changed(self, cache: Mapping[str, dict[str, Any]]) -> None:
        """The nodes whose devices changed are announced again (once the nodes were first announced)."""
        devices = node_devices(cache.values())
        changed = sorted(name for name in devices.keys() | self.devices.keys()
                         if devices.get(name) != self.devices.get(name))
        self.devices = devices
        if not changed or not self.announced:
            return
        async with self.seat.transaction() as tx:
            degraded = await self.verdicts(tx)
            for name in changed:
                obj = self.informer.cache.get(f"/{name}")
                if obj is None:
                    continue
                for failed in await inventory.publish_node(tx, obj, self.cfg, deleted=False, degraded=degraded,
                                                           loads=self.loads, devices=self.devices):
                    await self.node_failed(tx, failed)

    async def on_bound_pod(self, kind: str, pod: dict[str, Any]) -> None:
        """A pod bound to a node changed (bound, finished, gone): the nodes whose load it changed are announced
        again when what others hold there changed."""
        try:
            load = None if kind == "DELETED" else pod_load(pod)
        except ValueError as exc:
            log.warning("ignoring what pod %s holds: %s", key_of(pod), exc)
            load = None
        changed = self.loads.put(key_of(pod), load)
        if not changed or not self.announced:
            return  # before the first announcement, the loads are only recorded: it carries them
        async with self.seat.transaction() as tx:
            degraded = await self.verdicts(tx)
            for name in changed:
                obj = self.informer.cache.get(f"/{name}")
                if obj is None:
                    continue  # not a node this executor announces (yet)
                for failed in await inventory.publish_node(tx, obj, self.cfg, deleted=False, degraded=degraded,
                                                           loads=self.loads, devices=self.devices):
                    await self.node_failed(tx, failed)

    async def on_node(self, kind: str, obj: dict[str, Any]) -> None:
        if not self.announced:
            return  # the first list is announced whole by on_nodes_synced
        async with self.seat.transaction() as tx:
            changed = await inventory.publish_node(tx, obj, self.cfg, deleted=kind == "DELETED",
                                                   degraded=await self.verdicts(tx), loads=self.loads,
                                                   devices=self.devices)
            for name in changed:
                await self.node_failed(tx, name)
            if self.on_notice is not None and kind != "DELETED":
                await self.on_notice(tx, obj)

    async def on_nodes_synced(self, cache: dict[str, dict[str, Any]]) -> None:
        async with self.seat.transaction() as tx:
            failed = await inventory.publish_all(tx, list(cache.values()), self.cfg, first=not self.announced,
                                                 degraded=await self.verdicts(tx), loads=self.loads,
                                                 devices=self.devices)
            for name in failed:
                await self.node_failed(tx, name)
            if self.on_notice is not None:
                for key in sorted(cache):
                    await self.on_notice(tx, cache[key])
        self.announced = True

    async def node_failed(self, tx: Tx, node: str) -> None:
        """Jobs on a failed or removed node: requeued from their last checkpoint when they can checkpoint,
        else failed with NodeFailure. Their workloads are suspended either way (the pods go)."""
        rows = await tx.conn.fetch(
            "SELECT * FROM executor.kube_jobs WHERE state = ANY($1::text[]) AND placement @> $2::jsonb "
            "ORDER BY job_id FOR UPDATE", list(ACTIVE), json.dumps([{"node": node}]))
        for row in rows:
            spec = JobSpec.model_validate_json(row["spec"])
            message = f"node {node} failed or was removed"
            if spec.checkpoint.supported:
                await self.outcomes.requeue(tx, row, PreemptionReason.NODE_FAILURE, message, count=False)
            else:
                await self.outcomes.fail(tx, row, ExitReason.NODE_FAILURE, message + "; the job cannot checkpoint")

    async def verdicts(self, tx: Tx) -> inventory.Verdicts:
        """The nodes the DCGM source has degraded (none without the source)."""
        return await degraded_nodes(tx.conn, tx.schema) if self.degrades else inventory.NO_VERDICTS

    def node_specs(self) -> Mapping[str, NodeSpec]:
        return inventory.specs(list(self.informer.cache.values()), self.cfg, self.loads, self.devices)

    async def node_announced(self, tx: Tx, node: NodeSpec) -> None:
        for name in await inventory.record(tx, node):
            await self.node_failed(tx, name)
