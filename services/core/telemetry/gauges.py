"""The gauges the telemetry core's records read as: every series' current value at an instant `now` (an argument:
pure, no clock reads; every iteration that produces output is sorted)."""

from __future__ import annotations

from collections import defaultdict

from services.core.telemetry.fragmentation import fragmented_gpus
from services.core.telemetry.records import UNKNOWN, JobPhase, JobRecord, NodeSample
from services.core.telemetry.series import Gauges, Labels, labels
from services.core.telemetry.store import TelemetryRecords
from shared.domain import MILLI_GPU, NodeHealth, NodeSpec, mig_milli_gpus
from shared.events import GpuSample
from shared.mfu import mfu

MIB = 1024 * 1024
STALE_SAMPLE_INTERVALS = 3  # a node whose latest sample is older than this many intervals reports nothing
# A job's MFU is shown from its latest JobFlopsReported for this long; a job that stopped reporting shows the
# tensor-activity proxy only (reports are expected every few seconds to minutes).
FLOPS_REPORT_MAX_AGE_S = 900.0


def sample_share(s: GpuSample) -> float:
    """The part of a physical GPU a sample covers: 1, or a MIG instance's slice of it."""
    return mig_milli_gpus(s.mig_profile) / MILLI_GPU if s.gpu_instance is not None else 1.0


def _fresh_samples(st: TelemetryRecords, now: float) -> list[NodeSample]:
    return [s for _, s in sorted(st.samples.items())
            if now - s.sampled_at <= STALE_SAMPLE_INTERVALS * s.interval_s]


def read_gauges(st: TelemetryRecords, now: float) -> Gauges:
    """Every gauge's current series. Series with a value of zero are kept where their label set is
    stable (capacity, quotas) and dropped where they would only accumulate (per job, per reason)."""
    g: Gauges = defaultdict(lambda: defaultdict(float))
    jobs = [st.jobs[j] for j in sorted(st.jobs)]
    owner: dict[tuple[str, int], JobRecord] = {}
    for rec in jobs:
        if rec.holds_gpus:
            g["gpuq_running_jobs"][labels(**rec.labels())] += 1
            for node, gpu in rec.gpus:
                owner[(node, gpu)] = rec
                pool, model = st.node_labels(node)
                g["gpuq_gpus_allocated"][labels(**rec.labels(), pool=pool, gpu_model=model)] += 1
                g["gpuq_node_gpu_allocated"][labels(node=node, gpu=str(gpu), **rec.labels())] = 1
        else:
            g["gpuq_pending_jobs"][labels(**rec.labels(), stage=rec.stage, reason=rec.reason)] += 1
    _checkpoint_ages(jobs, now, g)
    per_job = _sample_gauges(st, now, owner, g)
    _capacity_gauges(st, g)
    _job_gauges(st, jobs, now, per_job, g)
    _mfu_gauges(st, jobs, now, g)
    _source_gauges(st, now, g)
    for model, total in st.guaranteed.items():
        g["gpuq_quota_guaranteed_gpus"][labels(gpu_model=model)] = total
    for resource, total in st.guaranteed_other.items():
        g["gpuq_quota_guaranteed"][labels(resource=resource)] = total
    for model, price in st.prices.items():
        g["gpuq_gpu_hourly_cost"][labels(gpu_model=model)] = price
    return {name: dict(series) for name, series in sorted(g.items())}


def _checkpoint_ages(jobs: list[JobRecord], now: float, g: Gauges) -> None:
    for rec in jobs:
        if rec.phase is not JobPhase.RUNNING or rec.spec is None or not rec.spec.checkpoint.supported:
            continue
        since = rec.last_checkpoint_at or rec.started_at
        if since is None:
            continue
        key = labels(queue=rec.queue)
        g["gpuq_checkpoint_age_max_seconds"][key] = max(g["gpuq_checkpoint_age_max_seconds"].get(key, 0.0),
                                                         max(0.0, now - since))


def _sample_gauges(st: TelemetryRecords, now: float, owner: dict[tuple[str, int], JobRecord],
                  g: Gauges) -> dict[str, list[tuple[GpuSample, float]]]:
    """Per-GPU and per-queue gauges from the fresh samples; returns each job's samples with their shares.

    A MIG-partitioned GPU has one sample per instance: the physical GPU's utilisation is the instances' sum
    weighted by their slices' shares (an unsampled slice counts as idle), and so is its memory."""
    per_job: dict[str, list[tuple[GpuSample, float]]] = defaultdict(list)
    for sample in _fresh_samples(st, now):
        pool, model = st.node_labels(sample.node, sample.gpu_model)
        for s in sorted(sample.samples, key=lambda s: (s.gpu_index, s.gpu_instance or -1)):
            share = sample_share(s)
            gpu_key = labels(node=sample.node, gpu=str(s.gpu_index), pool=pool, gpu_model=model)
            g["gpuq_node_gpu_utilization_ratio"][gpu_key] += share * s.utilization_pct / 100.0
            g["gpuq_node_gpu_memory_used_bytes"][gpu_key] += float(s.memory_used_mib * MIB)
            if s.tensor_active_pct is not None:
                g["gpuq_node_gpu_tensor_active_ratio"][gpu_key] += share * s.tensor_active_pct / 100.0
            # Bindings say who holds the GPU; the sample's job id covers placements we never saw
            # (e.g. after a restart mid-flight), but only while that job still holds GPUs. A sample's own
            # job id wins; a MIG instance has only its own (the bindings know the GPU, not the instance).
            rec = st.jobs.get(s.job_id) if s.job_id is not None else None
            if rec is None and s.gpu_instance is None:
                rec = owner.get((sample.node, s.gpu_index))
            if rec is None or not rec.holds_gpus:
                continue
            per_job[rec.job_id].append((s, share))
            key = labels(**rec.labels(), pool=pool, gpu_model=model)
            g["gpuq_gpus_used"][key] += share * s.utilization_pct / 100.0
            g["gpuq_gpu_memory_used_bytes"][key] += float(s.memory_used_mib * MIB)
            if s.tensor_active_pct is not None:
                g["gpuq_gpus_tensor_active"][key] += share * s.tensor_active_pct / 100.0
    return per_job


def _free_by_node(st: TelemetryRecords) -> dict[str, int]:
    held: dict[str, int] = defaultdict(int)
    for rec in st.jobs.values():
        if rec.holds_gpus:
            for node, _ in rec.gpus:
                held[node] += 1
    # what pods gpuq does not manage hold is not free to gpuq either (the scheduler places nothing there)
    return {name: max(0, r.node.gpus - held.get(name, 0) - r.node.held.gpus)
            for name, r in sorted(st.nodes.items())}


def _capacity_gauges(st: TelemetryRecords, g: Gauges) -> None:
    free = _free_by_node(st)
    waiting = [r.spec for _, r in sorted(st.jobs.items()) if not r.holds_gpus and r.spec is not None]
    nodes: list[NodeSpec] = [r.node for _, r in sorted(st.nodes.items())]
    fragmented = fragmented_gpus(nodes, free, waiting)
    for rec in (st.nodes[n] for n in sorted(st.nodes)):
        node = rec.node
        key = labels(pool=rec.pool, gpu_model=node.gpu_model)
        g["gpuq_nodes"][labels(pool=rec.pool, gpu_model=node.gpu_model, health=str(node.health))] += 1
        if node.health is NodeHealth.DEGRADED:
            g["gpuq_node_degraded"][labels(node=node.name, pool=rec.pool, gpu_model=node.gpu_model,
                                           reason=rec.reason or UNKNOWN)] = 1
        # Keep the pool's series present at zero so dashboards show 0 rather than "no data".
        for name in ("gpuq_gpus_capacity", "gpuq_gpus_free", "gpuq_gpus_fragmented", "gpuq_gpus_held_outside"):
            g[name][key] += 0
        where = labels(node=node.name, pool=rec.pool, gpu_model=node.gpu_model)
        if node.held.gpus:
            g["gpuq_node_gpus_held_outside"][where] = node.held.gpus
        if node.held.mig_slices:
            g["gpuq_node_mig_slices_held_outside"][where] = node.held.mig_slices
        if node.health is not NodeHealth.READY:
            continue
        g["gpuq_gpus_capacity"][key] += node.gpus
        g["gpuq_gpus_held_outside"][key] += min(node.gpus, node.held.gpus)
        g["gpuq_gpus_free"][key] += free[node.name]
        g["gpuq_gpus_fragmented"][key] += fragmented.get(node.name, 0)


def _job_gauges(st: TelemetryRecords, jobs: list[JobRecord], now: float,
                per_job: dict[str, list[tuple[GpuSample, float]]], g: Gauges) -> None:
    chosen = sorted(jobs, key=lambda r: (r.queue, r.job_id))[: st.job_series_cap]
    for rec in chosen:
        key = labels(job_id=rec.job_id, **rec.labels())
        if rec.holds_gpus:
            g["gpuq_job_gpus_allocated"][key] = len(rec.gpus)
            seen = per_job.get(rec.job_id, [])
            if seen:  # each instance's utilisation is of its own slice: a plain mean over what the job holds
                g["gpuq_job_gpu_utilization_ratio"][key] = sum(s.utilization_pct for s, _ in seen) / 100 / len(seen)
                tensors = [s.tensor_active_pct for s, _ in seen if s.tensor_active_pct is not None]
                if tensors:
                    g["gpuq_job_tensor_active_ratio"][key] = sum(tensors) / 100 / len(tensors)
            continue
        g["gpuq_job_pending_info"][labels(job_id=rec.job_id, **rec.labels(), stage=rec.stage,
                                          reason=rec.reason)] = 1
        if rec.position is not None:
            g["gpuq_job_queue_position"][key] = rec.position
        if rec.eta is not None:
            g["gpuq_job_eta_timestamp_seconds"][key] = rec.eta
        if rec.queued_at is not None:
            g["gpuq_job_waiting_seconds"][key] = max(0.0, now - rec.queued_at)


def _mfu_gauges(st: TelemetryRecords, jobs: list[JobRecord], now: float, g: Gauges) -> None:
    """MFU per job (capped like every per-job series) and its GPU-weighted mean per queue/team."""
    cap = {r.job_id for r in sorted(jobs, key=lambda r: (r.queue, r.job_id))[: st.job_series_cap]}
    weighted: dict[Labels, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for rec in jobs:
        f = rec.flops
        if f is None or rec.phase is not JobPhase.RUNNING or now - f.reported_at > FLOPS_REPORT_MAX_AGE_S:
            continue
        ratio = mfu(f.tflops, st.peak(rec, f.precision))
        if ratio is None:
            continue
        if rec.job_id in cap:
            g["gpuq_job_mfu_ratio"][labels(job_id=rec.job_id, **rec.labels(), precision=str(f.precision))] = ratio
        gpus = sum(m for _, m in rec.shares) / MILLI_GPU
        acc = weighted[labels(**rec.labels())]
        acc[0] += ratio * gpus
        acc[1] += gpus
    for key, (num, den) in sorted(weighted.items()):
        if den > 0:
            g["gpuq_mfu_ratio"][key] = num / den


def _source_gauges(st: TelemetryRecords, now: float, g: Gauges) -> None:
    for name, rec in sorted(st.sources.items()):
        key = labels(source=name)
        # A source that stopped reporting (its executor is gone) is down, not up forever.
        fresh = rec.interval_s is None or now - rec.checked_at <= STALE_SAMPLE_INTERVALS * rec.interval_s
        g["gpuq_utilization_source_up"][key] = 1.0 if rec.ok and fresh else 0.0
        if rec.last_ok_at is not None:
            g["gpuq_utilization_source_last_success_timestamp_seconds"][key] = rec.last_ok_at
        for kind, count in (("exact", rec.gpus_exact), ("approximate", rec.gpus_approximate),
                            ("unattributed", rec.gpus_unattributed)):
            g["gpuq_utilization_source_gpus"][labels(source=name, attribution=kind)] = count


__all__ = ["FLOPS_REPORT_MAX_AGE_S", "MIB", "STALE_SAMPLE_INTERVALS", "read_gauges", "sample_share"]
