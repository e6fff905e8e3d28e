"""Load a trace the way the command line asks, and replay it under each policy."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shared.config import ClusterConfig, load_cluster, load_queues
from sim.engine import Engine, Policy, SimResult
from sim.failures import NodeFailure, synth_node_failures
from sim.loaders import (
    TraceError,
    Window,
    load_generic_csv,
    load_openb,
    load_philly,
    month_window,
    parse_time,
)
from sim.metrics import compute_metrics, isolated_finish_times
from sim.model import Trace
from sim.policies import POLICIES
from sim.policies.baselines import PodFifo, QuotaFifo
from sim.policies.gpuq import GpuqPolicy, cores_available
from sim.policies.kueue import Kueue
from sim.policies.slurm import Slurm
from sim.policies.volcano import Volcano


def _chooser(checkpointing: bool) -> Callable[[Any], Any]:
    """The production victim chooser of the decision loop's preemption stage, for the trace's queues."""

    def make(queues: Any) -> Any:
        from services.core.pipeline import VictimChooser

        return VictimChooser(queues, checkpointing=checkpointing)

    return make


def make_policy(name: str) -> Policy:
    if name.startswith("gpuq"):
        if not cores_available():
            raise TraceError("policy gpuq needs services.core.admission and services.core.scheduler")
        if name in ("gpuq", "gpuq-duration", "gpuq-fairtime", "gpuq-evict", "gpuq-nopreempt", "gpuq-defrag"):
            policy = (GpuqPolicy() if name == "gpuq-nopreempt"
                      else GpuqPolicy(preemption=_chooser(checkpointing=name != "gpuq-evict"),
                                      duration_aware=name == "gpuq-duration",
                                      history_half_life_s=7 * 86_400.0 if name == "gpuq-fairtime" else None,
                                      defrag=name == "gpuq-defrag"))
            policy.name = name
            return policy
        if name in ("gpuq-elastic", "gpuq-pods1"):  # sim/elastic.py: the rule and its fixed twin
            policy = GpuqPolicy(preemption=_chooser(checkpointing=True), elastic=name.removeprefix("gpuq-"))
            policy.name = name
            return policy
    if name == "kueue":
        return Kueue()
    if name == "slurm":
        return Slurm()
    if name == "volcano":
        return Volcano()
    if name == "volcano-hami":
        from sim.policies.hami import VolcanoHami

        return VolcanoHami()
    if name == "quota-fifo":
        return QuotaFifo()
    if name == "pod-fifo":
        return PodFifo()
    raise TraceError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")


@dataclass(frozen=True)
class TraceOptions:
    trace: Path
    fmt: str = "auto"  # auto | generic | philly | openb
    cluster: Path | None = None
    queues: Path | None = None
    start: str | None = None
    end: str | None = None
    month: str | None = None
    cluster_scale: float = 1.0
    load: float | None = None
    arrival_scale: float = 1.0  # > 1 compresses inter-arrival times (more load on the same cluster)
    topology: Path | None = None
    seed: int = 0
    max_jobs: int | None = None
    gpu_sharing: str = "round"  # openb: round fractions up (round) or replay them as fractions (time-slicing|mps)


def detect_format(path: Path) -> str:
    with path.open() as fh:
        header = fh.readline().strip().split(",")
    if header[:3] == ["timestamp", "duration", "num_gpus"]:
        return "philly"
    if "gpu_milli" in header and "qos" in header:
        return "openb"
    if header[:5] == ["job_id", "submit_time", "duration", "gpus", "team"]:
        return "generic"
    raise TraceError(f"{path}: unknown trace format (header {','.join(header[:6])}); expected the generic CSV "
                     "job_id,submit_time,duration,gpus,team[,...], philly.csv or the openb pod list")


def _window(opts: TraceOptions) -> Window:
    if opts.month:
        return month_window(opts.month)
    return Window(parse_time(opts.start) if opts.start else None, parse_time(opts.end) if opts.end else None)


def scale_cluster(cfg: ClusterConfig, scale: float) -> ClusterConfig:
    groups = tuple(g.model_copy(update={"count": max(1, round(g.count * scale))}) for g in cfg.node_groups)
    return cfg.model_copy(update={"node_groups": groups})


def _load_once(opts: TraceOptions, fmt: str, scale: float) -> Trace:
    window = _window(opts)
    if fmt == "philly":
        trace = load_philly(opts.trace, window=window, seed=opts.seed, cluster_scale=scale)
    elif fmt == "openb":
        if scale != 1.0:
            raise TraceError("--cluster-scale/--load are not supported for the openb trace (a fixed real cluster)")
        trace = load_openb(opts.trace, topology_path=opts.topology, window=window, seed=opts.seed,
                           sharing=opts.gpu_sharing)
    else:
        if opts.cluster is None:
            raise TraceError("the generic CSV needs --cluster cluster.yaml")
        cluster = scale_cluster(load_cluster(opts.cluster), scale)
        nodes = cluster.nodes(base_dir=opts.cluster.parent)
        trace = load_generic_csv(opts.trace, nodes, None, window=window, seed=opts.seed)
    if opts.cluster is not None and fmt != "generic":
        cluster = scale_cluster(load_cluster(opts.cluster), scale)
        trace.nodes = cluster.nodes(base_dir=opts.cluster.parent)
    if opts.queues is not None:
        # A queues.yaml is taken as written (never scaled): it is the what-if being asked. Dump the generated
        # one with --write-queues, edit it, and pass it back with the same --load/--cluster-scale.
        trace.queues = load_queues(opts.queues)
    if opts.topology is not None and fmt != "openb":
        from shared.config import apply_topology, load_topology_csv

        trace.nodes = apply_topology(trace.nodes, load_topology_csv(opts.topology))
    if opts.max_jobs is not None:
        trace.jobs = trace.jobs[: opts.max_jobs]
    if opts.arrival_scale != 1.0:
        trace.jobs = [replace(j, submit_time=round(j.submit_time / opts.arrival_scale)) for j in trace.jobs]
    trace.info["cluster_scale"] = scale
    return trace


def load_trace(opts: TraceOptions) -> Trace:
    """The trace, windowed and scaled. `load` picks the cluster scale so offered load ≈ load."""
    fmt = detect_format(opts.trace) if opts.fmt == "auto" else opts.fmt
    trace = _load_once(opts, fmt, opts.cluster_scale)
    if opts.load is not None:
        # Offered load scales as 1/scale; node counts are rounded (and each Philly VC keeps a node), so a
        # few fixed-point steps land closer to the target than one.
        scale = opts.cluster_scale
        for _ in range(3):
            offered = trace.offered_load()
            if offered <= 0:
                raise TraceError("--load: the window holds no work")
            if abs(offered / opts.load - 1) < 0.01:
                break
            scale *= offered / opts.load
            trace = _load_once(opts, fmt, scale)
    # Jobs no cluster of this size could ever hold are dropped for every policy alike.
    biggest = trace.capacity_gpus
    too_big = [j.job_id for j in trace.jobs if j.gpus > biggest]
    if too_big:
        trace.jobs = [j for j in trace.jobs if j.gpus <= biggest]
    trace.info.update({"dropped_larger_than_cluster": len(too_big), "offered_load": round(trace.offered_load(), 4),
                       "jobs": len(trace.jobs), "capacity_gpus": trace.capacity_gpus, "nodes": len(trace.nodes)})
    return trace


@dataclass
class PolicyRun:
    metrics: dict[str, Any]
    result: SimResult


def node_failures(trace: Trace, mtbf_h: float | None, repair_h: float, seed: int) -> list[NodeFailure]:
    """The replay's node failures (`--node-mtbf-h`), over the submission window; none when not asked."""
    if mtbf_h is None:
        return []
    horizon = float(trace.jobs[-1].submit_time) if trace.jobs else 0.0
    try:
        return synth_node_failures(trace.nodes, horizon, mtbf_h, repair_h, seed)
    except ValueError as exc:
        raise TraceError(str(exc)) from None


ETA_MODES = ("off", "predicted", "limits")


def run_policies(trace: Trace, policies: Sequence[str],
                 progress: Callable[[str, int], None] | None = None,
                 failures: Sequence[NodeFailure] = (), eta: str = "off", eta_range: str = "replays"
                 ) -> list[PolicyRun]:
    """Replay `trace` under each policy. `eta` other than "off" also gives ETAs to waiting jobs with the
    production ETA code for the policies that have ETAs (gpuq*) and adds their accuracy to the metrics:
    "predicted" (predicted durations, calibrated range) or "limits" (every job runs its whole limit).
    `eta_range`: how the range is made (services.core.eta.RANGE_METHODS: "replays" or "calibrated")."""
    from services.core.eta import RANGE_METHODS

    if eta not in ETA_MODES:
        raise TraceError(f"unknown ETA mode {eta!r}; choose from {', '.join(ETA_MODES)}")
    if eta_range not in RANGE_METHODS:
        raise TraceError(f"unknown ETA range method {eta_range!r}; choose from {', '.join(RANGE_METHODS)}")
    isolated = isolated_finish_times(trace)
    runs: list[PolicyRun] = []
    for name in policies:
        policy = make_policy(name)
        tracked = None
        if eta != "off" and name.startswith("gpuq"):
            from services.core.eta import EtaModel
            from sim.eta_accuracy import EtaTracked

            predict = eta == "predicted"
            policy = tracked = EtaTracked(policy, EtaModel(predict=predict, calibrate=predict,
                                                           range_method=eta_range))
        cb = (lambda done, _n=name: progress(_n, done)) if progress else None
        t0 = time.perf_counter()
        result = Engine(trace, policy, progress=cb, failures=failures).run()
        wall = time.perf_counter() - t0
        metrics = compute_metrics(result, wall, isolated)
        if tracked is not None:
            from sim.eta_accuracy import eta_metrics

            metrics.update(eta_metrics(tracked, result))
        runs.append(PolicyRun(metrics, result))
    return runs


def trace_summary(trace: Trace) -> dict[str, Any]:
    return {"name": trace.name, "epoch0": trace.epoch0, **{k: trace.info[k] for k in sorted(trace.info)}}


def queues_yaml(trace: Trace) -> str:
    """The queues the replay used, as a queues.yaml (edit it for a what-if and pass it back with --queues)."""
    import yaml

    return yaml.safe_dump(trace.queues.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
