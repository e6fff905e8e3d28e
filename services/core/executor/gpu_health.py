"""GPU health from DCGM: which nodes become degraded, and when they are ready again.

A node is degraded when, in a poll that has series for it:
- a device reports an XID error (`DCGM_FI_DEV_XID_ERRORS`, the last XID code, > 0) that is not an application
  error (settings.ignore_xids: by default those NVIDIA's device plugin ignores, see shared/config.py); or
- a GPU the node should have (NodeSpec.gpus) has had no series for `missing_gpu_polls` polls in a row while the
  node's other GPUs had: it has fallen off the bus (XID 79 is often never reported, because the GPU is gone).

A degraded node is ready again after `recovery_polls` polls in a row with series and without any fault (the XID
gauge keeps its last code until the GPU or driver is reset, so this means the fault was cleared). A node without
any series is not assessed at all: an exporter that is down says nothing about the GPUs. Only nodes the executor
reports READY are degraded (a cordoned or failed node keeps the executor's health). A verdict outlives the node's
absence from the executor's list: it ends only with clean polls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.core.executor.dcgm_series import DcgmField, ParsedSeries
from shared.domain import NodeHealth, NodeSpec

# Meanings of the XIDs that most often take a node out (NVIDIA's XID catalogue); the rest are named by number.
XID_MEANINGS = {
    48: "double-bit ECC error", 61: "internal micro-controller breakpoint", 62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event", 64: "ECC page retirement or row remapping failure",
    74: "NVLink error", 79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate",
    94: "contained ECC error", 95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
    140: "unrecovered ECC error",
}


@dataclass(frozen=True, order=True)
class GpuFault:
    node: str
    gpu: int
    reason: str  # "Xid<N>" or "GpuMissing"
    message: str


@dataclass(frozen=True)
class HealthChange:
    node: NodeSpec  # the node as the executor reports it, with the new health
    reason: str | None
    message: str


@dataclass
class HealthMemory:
    """What the assessment carries from one poll to the next. `degraded` (node -> reason, message) is persisted
    by the shell; the streaks are soft state (after a restart they start again from zero)."""

    degraded: dict[str, tuple[str, str]] = field(default_factory=dict)
    missing_streak: dict[tuple[str, int], int] = field(default_factory=dict)
    clean_streak: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class HealthPolicy:
    ignore_xids: frozenset[int]
    missing_gpu_polls: int
    recovery_polls: int


def xid_message(xid: int) -> str:
    meaning = XID_MEANINGS.get(xid)
    return f"XID {xid} ({meaning})" if meaning else f"XID {xid}"


def faults_of(parsed: ParsedSeries, nodes: Mapping[str, NodeSpec], memory: HealthMemory,
              policy: HealthPolicy) -> tuple[dict[str, list[GpuFault]], dict[tuple[str, int], int]]:
    """Faults per assessed node (nodes with series this poll), and the new missing-GPU streaks."""
    faults: dict[str, list[GpuFault]] = {}
    streaks: dict[tuple[str, int], int] = {}
    for name, readings in parsed.by_node().items():
        node = nodes.get(name)
        if node is None:
            continue
        found = faults.setdefault(name, [])
        for r in readings:
            xid = r.get(DcgmField.XID)
            code = int(xid) if xid is not None else 0
            if code > 0 and code not in policy.ignore_xids:
                where = f"GPU {r.device.gpu}" + (f" (MIG instance {r.device.instance})"
                                                 if r.device.instance is not None else "")
                found.append(GpuFault(name, r.device.gpu, f"Xid{code}", f"{xid_message(code)} on {where}"))
        seen = {r.device.gpu for r in readings}
        for gpu in range(node.gpus):
            if gpu in seen:
                continue
            streak = memory.missing_streak.get((name, gpu), 0) + 1
            streaks[(name, gpu)] = streak
            if streak >= policy.missing_gpu_polls:
                found.append(GpuFault(name, gpu, "GpuMissing",
                                      f"GPU {gpu} has reported no DCGM series for {streak} polls while the node's "
                                      "other GPUs did (fallen off the bus?)"))
    # Streaks of nodes not assessed this poll are kept as they were.
    for key, streak in memory.missing_streak.items():
        if key[0] not in faults:
            streaks[key] = streak
    return {n: sorted(set(f)) for n, f in faults.items()}, streaks


def assess(parsed: ParsedSeries, nodes: Mapping[str, NodeSpec], memory: HealthMemory,
           policy: HealthPolicy) -> tuple[HealthMemory, list[HealthChange]]:
    """The next memory and the nodes whose health changes now (sorted by node)."""
    faults, streaks = faults_of(parsed, nodes, memory, policy)
    # Verdicts of nodes the executor does not list now are kept, as in the health table: a node that leaves and
    # registers again (repaired, or an informer relisting) is announced degraded again and recovers only here.
    degraded = dict(memory.degraded)
    clean: dict[str, int] = {}
    changes: list[HealthChange] = []
    for name in sorted(faults):
        node, found = nodes[name], faults[name]
        if found:
            message = "; ".join(f.message for f in found)
            if name not in degraded and node.health is NodeHealth.READY:
                changes.append(HealthChange(node.model_copy(update={"health": NodeHealth.DEGRADED}),
                                            found[0].reason, message))
                degraded[name] = (found[0].reason, message)
            continue
        if name not in degraded:
            continue
        clean[name] = memory.clean_streak.get(name, 0) + 1
        if clean[name] >= policy.recovery_polls:
            reason, _ = degraded.pop(name)
            del clean[name]
            changes.append(HealthChange(node, None, f"no GPU fault for {policy.recovery_polls} polls "
                                                    f"(was {reason}): ready again"))
    for name, streak in memory.clean_streak.items():
        if name not in faults and name in degraded:
            clean[name] = streak
    return HealthMemory(degraded=degraded, missing_streak=streaks, clean_streak=clean), changes
