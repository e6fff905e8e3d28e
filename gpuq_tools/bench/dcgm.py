"""`gpuq bench dcgm`: the CPU cost of one DCGM poll on a big cluster (parse the Prometheus replies, attribute,
assess health, build the UtilizationSampled events), without the network; and what the Kubernetes executor adds
to each poll (mapping its informer's Node objects and pods to the source's view)."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress

from services.core.executor.attribution import JobShare, Placements, attribute
from services.core.executor.dcgm_series import DcgmField, Device, parse_results
from services.core.executor.gpu_health import HealthMemory, HealthPolicy, assess
from services.core.kube import dcgm_view
from services.core.kube.names import job_label
from services.executor.kube import inventory
from shared.config import APPLICATION_XIDS, DcgmLabels, KubernetesSource
from shared.domain import GpuBinding, NodeSpec
from shared.events import UtilizationSampled, make_event, utcnow_from

T0 = 1_767_225_600.0


def synthetic_poll(nodes: int) -> tuple[dict[DcgmField, list[dict[str, Any]]], Placements, dict[str, NodeSpec]]:
    """Prometheus replies for `nodes` × 8 GPUs: a quarter of the nodes with pod labels, a quarter known per device,
    a quarter shared by two jobs known per node only (node-level split), a quarter free."""
    results: dict[DcgmField, list[dict[str, Any]]] = {f: [] for f in DcgmField}
    pods: dict[tuple[str, str], str] = {}
    devices: dict[Device, str] = {}
    per_node: dict[str, tuple[JobShare, ...]] = {}
    specs: dict[str, NodeSpec] = {}
    for i in range(nodes):
        name = f"n{i:04d}"
        specs[name] = NodeSpec(name=name, gpus=8, gpu_model="H100", cpu_milli=1, memory_mib=1, rack="r", block="b")
        kind = i % 4
        job = f"job-{i}"
        if kind in (0, 1):
            per_node[name] = (JobShare(job, 8),)
        elif kind == 2:
            per_node[name] = (JobShare(f"{job}-a", 4), JobShare(f"{job}-b", 4))
        for g in range(8):
            labels = {"Hostname": name, "gpu": str(g), "UUID": f"GPU-{i}-{g}", "modelName": "NVIDIA H100"}
            if kind == 0:
                labels |= {"exported_namespace": "team", "exported_pod": f"{job}-main-{g}"}
                pods[("team", f"{job}-main-{g}")] = job
            elif kind == 1:
                devices[Device(name, g)] = job
            for f, v in ((DcgmField.GR_ENGINE_ACTIVE, 0.5 + g / 100), (DcgmField.FB_USED, 40_000.0),
                         (DcgmField.FB_FREE, 40_000.0), (DcgmField.POWER, 400.0), (DcgmField.TEMP, 60.0),
                         (DcgmField.TENSOR_ACTIVE, 0.3), (DcgmField.XID, 0.0), (DcgmField.GPU_UTIL, 50.0)):
                results[f].append({"metric": labels, "value": [T0, str(v)]})
    return results, Placements(pods=pods, devices=devices, nodes=per_node), specs


def kube_objects(nodes: int) -> tuple[list[dict[str, Any]], list[dcgm_view.RunningJob], list[dict[str, Any]]]:
    """The Kubernetes executor's side: Node objects as its informer holds them, and a running job per node with
    one 8-GPU pod each, plus as many pods of jobs that do not run (finished, or someone else's)."""
    objects: list[dict[str, Any]] = []
    running: list[dcgm_view.RunningJob] = []
    pods: list[dict[str, Any]] = []
    for i in range(nodes):
        name = f"n{i:04d}"
        objects.append({"metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "81559", "feature.node.kubernetes.io/x": "1"}},
            "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": "8", "cpu": "95500m", "memory": "1056000Mi"},
                                   "conditions": [{"type": "Ready", "status": "True"}]}})
        job = f"team.job-{i}.0a1b2c3d"
        running.append(dcgm_view.RunningJob(job, job_label(job), [GpuBinding(pod="main-0", node=name,
                                                                             gpu_indices=tuple(range(8)))], "team"))
        for j, label in ((0, job_label(job)), (1, job_label(f"done-{i}"))):
            pods.append({"metadata": {"namespace": "team", "name": f"job-{i}-{j}-x7k2p", "labels": {
                "gpuq.io/job": label, "batch.kubernetes.io/job-name": f"job-{i}"}}})
    return objects, running, pods


def bench_dcgm(
    nodes: int = typer.Option(512, help="Nodes of 8 GPUs each."),
    rounds: int = typer.Option(5, help="Polls to time (the median is printed)."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """Time the DCGM source's work per poll: parsing the series, attribution, health and event building."""
    results, placements, specs = synthetic_poll(nodes)
    node_objects, running, pods = kube_objects(nodes)
    kube_cfg = KubernetesSource(gpu_flavors={"NVIDIA-H100-80GB-HBM3": "H100-80GB"})
    policy = HealthPolicy(frozenset(APPLICATION_XIDS), 3, 3)
    memory = HealthMemory()
    phases: dict[str, list[float]] = {"parse_s": [], "attribute_s": [], "health_s": [], "events_s": [],
                                      "kube_view_s": []}
    batches = 0
    with Progress(transient=True) as progress:
        task = progress.add_task("polls", total=rounds)
        for _ in range(rounds):
            t0 = time.perf_counter()
            parsed = parse_results(results, DcgmLabels())
            t1 = time.perf_counter()
            out = attribute(parsed, placements, specs)
            t2 = time.perf_counter()
            memory, _ = assess(parsed, specs, memory, policy)
            t3 = time.perf_counter()
            for b in out.batches:
                make_event(UtilizationSampled(node=b.node, gpu_model=b.gpu_model, sampled_at=utcnow_from(T0),
                                              interval_s=15, samples=b.samples, source="dcgm"),
                           source="bench", time=utcnow_from(T0))
            t4 = time.perf_counter()
            inventory.specs(node_objects, kube_cfg)  # KubeExecutor.node_specs and .placements, without the query
            dcgm_view.placements(running, pods)
            t5 = time.perf_counter()
            batches = len(out.batches)
            for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                phases[key].append(value)
            progress.advance(task)
    medians = {k: round(statistics.median(v), 4) for k, v in phases.items()}
    figures: dict[str, Any] = {"nodes": nodes, "gpus": nodes * 8, "series": parsed.series, "batches": batches,
                               "exact": out.exact, "approximate": out.approximate, "unattributed": out.unattributed,
                               **medians, "poll_cpu_s": round(sum(medians.values()), 4)}
    if as_json:
        typer.echo(json.dumps(figures))
        return
    console = Console()
    for k, v in figures.items():
        console.print(f"{k:>14}: {v}")
