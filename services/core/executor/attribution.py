"""Which job each DCGM device reading belongs to, and the UtilizationSampled batches that result.

In order of trust, per device (a whole GPU, or a MIG instance on a MIG-partitioned node):
1. **pod labels** — `(namespace, pod)` from the series (exported_* first), looked up in the executor's pods;
2. **device join** — `(node, gpu index[, GPU instance])`, else `(GPU UUID[, instance])`, looked up in what the
   executor knows of which job holds which device (the simulated executor knows; Kubernetes does not: the
   device plugin, not gpuq, picks the GPUs of a pod);
3. **sole holder** — a job that holds every device of the node, on a node that reports no more devices than
   that, owns each of them (exact): the usual case of a training job taking whole nodes, which an executor
   that does not know device indices (Kubernetes, where the device plugin picks them) still knows exactly;
4. **node-level split** — a job known to run on the node with units (GPUs, or MIG slices) no step above
   found gets that many of the node's still-unattributed devices (those holding the most memory first: a
   GPU with a process on it holds memory, a free one almost none). Every such sample carries the *mean* of
   the devices taken, so no job is credited with one particular GPU's numbers, and is marked `approximate`;
5. anything left is sampled with no job (the node's free GPUs: capacity and idle figures still need them).

Pure and deterministic: nodes, devices and jobs are visited in sorted order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.core.executor.dcgm_series import DcgmField, Device, DeviceReading, ParsedSeries
from shared.domain import MILLI_GPU, GpuBinding, NodeSpec, mig_milli_gpus
from shared.events import GpuSample


@dataclass(frozen=True)
class JobShare:
    """A job's units on one node: whole GPUs, or MIG slices on a MIG-partitioned node."""

    job_id: str
    units: int


@dataclass(frozen=True)
class Placements:
    """What the executor knows of which job runs where (the executor's side of the attribution)."""

    pods: Mapping[tuple[str, str], str] = field(default_factory=dict)  # (namespace, pod) -> job
    devices: Mapping[Device, str] = field(default_factory=dict)  # (node, gpu, MIG instance or None) -> job
    uuids: Mapping[tuple[str, int | None], str] = field(default_factory=dict)  # (GPU UUID, instance) -> job
    nodes: Mapping[str, tuple[JobShare, ...]] = field(default_factory=dict)  # node -> jobs and their units


def units_by_node(placed: Iterable[tuple[str, Iterable[GpuBinding]]]) -> dict[str, tuple[JobShare, ...]]:
    """`Placements.nodes` from (job, bindings) pairs: per node, each job's whole GPUs plus MIG slices there."""
    per_node: dict[str, dict[str, int]] = {}
    for job_id, bindings in placed:
        for b in bindings:
            units = per_node.setdefault(b.node, {})
            units[job_id] = units.get(job_id, 0) + len(b.gpu_indices) + (1 if b.mig_slice is not None else 0)
    return {n: tuple(JobShare(j, u) for j, u in sorted(jobs.items()) if u > 0)
            for n, jobs in sorted(per_node.items())}


@dataclass
class NodeBatch:
    node: str
    gpu_model: str
    samples: tuple[GpuSample, ...]


@dataclass
class Attribution:
    batches: list[NodeBatch] = field(default_factory=list)
    exact: int = 0
    approximate: int = 0
    unattributed: int = 0
    no_utilisation: int = 0  # devices with no utilisation series (not sampled)
    unknown_nodes: list[str] = field(default_factory=list)  # node labels the executor does not have


@dataclass
class _Unit:
    """One sampled device with the numbers a GpuSample needs."""

    reading: DeviceReading
    util_pct: float
    memory_mib: int
    power_w: float
    temperature_c: float | None
    tensor_pct: float | None
    job_id: str | None = None


def _pct(ratio: float | None) -> float | None:
    return None if ratio is None else min(100.0, max(0.0, ratio * 100.0))


def _units(readings: list[DeviceReading], node: NodeSpec) -> tuple[list[_Unit], int]:
    """The devices that are scheduling units on this node, with their values; and how many had no utilisation."""
    parents = {r.device.gpu: r for r in readings if r.device.instance is None}
    mig = node.mig is not None
    units: list[_Unit] = []
    skipped = 0
    for r in readings:
        if (r.device.instance is not None) != mig:
            continue  # a MIG node's parent series only lend power/temperature; a whole-GPU node ignores instances
        util = _pct(r.get(DcgmField.GR_ENGINE_ACTIVE))
        if util is None and not mig and (fallback := r.get(DcgmField.GPU_UTIL)) is not None:
            util = min(100.0, fallback)  # DCGM_FI_DEV_GPU_UTIL is a percentage, and only meaningful per whole GPU
        if util is None:
            skipped += 1
            continue
        parent = parents.get(r.device.gpu)
        if mig:
            # An instance's share of its GPU's power: DCGM measures power per physical GPU only.
            power = (parent.get(DcgmField.POWER) or 0.0) if parent is not None else 0.0
            power = power * mig_milli_gpus(r.profile or (node.mig.profile if node.mig else None)) / MILLI_GPU
        else:
            power = r.get(DcgmField.POWER) or 0.0
        temp = r.get(DcgmField.TEMP)
        if temp is None and parent is not None:
            temp = parent.get(DcgmField.TEMP)
        units.append(_Unit(reading=r, util_pct=util, memory_mib=round(r.get(DcgmField.FB_USED) or 0.0),
                           power_w=round(power, 3), temperature_c=temp,
                           tensor_pct=_pct(r.get(DcgmField.TENSOR_ACTIVE))))
    return units, skipped


def _sample(u: _Unit, *, job_id: str | None, approximate: bool = False, util: float | None = None,
            memory: int | None = None, power: float | None = None, tensor: float | None = None) -> GpuSample:
    r = u.reading
    fb_free = r.get(DcgmField.FB_FREE)
    return GpuSample(
        job_id=job_id, gpu_index=r.device.gpu,
        utilization_pct=u.util_pct if util is None else util,
        memory_used_mib=u.memory_mib if memory is None else memory,
        power_w=u.power_w if power is None else power,
        temperature_c=u.temperature_c, gpu_uuid=r.uuid, gpu_instance=r.device.instance,
        mig_profile=r.profile if r.device.instance is not None else None,
        fb_free_mib=round(fb_free) if fb_free is not None else None,
        tensor_active_pct=u.tensor_pct if tensor is None else tensor, approximate=approximate)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _split(units: list[_Unit], wanted: list[tuple[str, int]]) -> list[tuple[str, _Unit]]:
    """Node-level split: hand the unattributed devices that hold the most memory to the jobs in `wanted`."""
    pool = sorted((u for u in units if u.job_id is None),
                  key=lambda u: (-u.memory_mib, u.reading.device.gpu, u.reading.device.instance or -1))
    out: list[tuple[str, _Unit]] = []
    for job_id, count in wanted:
        for u in pool[len(out):len(out) + count]:
            out.append((job_id, u))
    return out


def _sole_holder(shares: list[JobShare], node: NodeSpec, reported: int, device_level: set[str]) -> str | None:
    """The job that holds every device of the node, when it is the node's only job and the node reports no more
    devices than that (a GPU the device plugin hides from allocatable still has series: then which are the job's
    is unknown, and the split applies)."""
    capacity = node.gpus * (node.mig.slices_per_gpu if node.mig is not None else 1)
    if len(shares) != 1 or capacity == 0 or reported > capacity:
        return None
    share = shares[0]
    return share.job_id if share.units >= capacity and share.job_id not in device_level else None


def attribute(parsed: ParsedSeries, placements: Placements, nodes: Mapping[str, NodeSpec]) -> Attribution:
    out = Attribution()
    # Jobs the executor places at device level are fully known: a device of theirs without series stays
    # unsampled rather than borrowing a free GPU's numbers in a node-level split.
    device_level = set(placements.devices.values()) | set(placements.uuids.values())
    for node_name, readings in parsed.by_node().items():
        node = nodes.get(node_name)
        if node is None:
            out.unknown_nodes.append(node_name)
            continue
        units, skipped = _units(readings, node)
        out.no_utilisation += skipped
        exact: dict[str, int] = {}
        for u in units:
            r = u.reading
            job = placements.pods.get(r.pod) if r.pod is not None else None
            if job is None:
                job = placements.devices.get(r.device)
            if job is None and r.uuid:
                job = placements.uuids.get((r.uuid, r.device.instance))
            if job is not None:
                u.job_id = job
                exact[job] = exact.get(job, 0) + 1
        shares = sorted(placements.nodes.get(node_name, ()), key=lambda s: s.job_id)
        sole = _sole_holder(shares, node, len(units) + skipped, device_level)
        if sole is not None:
            for u in units:
                u.job_id = u.job_id or sole
        wanted = [(s.job_id, s.units - exact.get(s.job_id, 0)) for s in shares
                  if s.job_id not in device_level and s.job_id != sole and s.units > exact.get(s.job_id, 0)]
        split = _split(units, wanted)
        samples: list[GpuSample] = []
        if split:
            taken = [u for _, u in split]
            util = _mean([u.util_pct for u in taken])
            memory = round(_mean([float(u.memory_mib) for u in taken]))
            power = round(_mean([u.power_w for u in taken]), 3)
            tensors = [u.tensor_pct for u in taken if u.tensor_pct is not None]
            tensor = _mean(tensors) if len(tensors) == len(taken) else None
            for job_id, u in split:
                u.job_id = job_id
                samples.append(_sample(u, job_id=job_id, approximate=True, util=util, memory=memory, power=power,
                                       tensor=tensor))
            out.approximate += len(split)
        approximated = {id(u) for _, u in split}
        for u in units:
            if id(u) in approximated:
                continue
            samples.append(_sample(u, job_id=u.job_id))
            if u.job_id is None:
                out.unattributed += 1
            else:
                out.exact += 1
        samples.sort(key=lambda s: (s.gpu_index, -1 if s.gpu_instance is None else s.gpu_instance))
        if samples:
            out.batches.append(NodeBatch(node=node_name, gpu_model=node.gpu_model, samples=tuple(samples)))
    return out
