"""`gpuq bench placement`: decision throughput and latency of the placement core on a churning cluster.

The cluster is first filled to ~90% with the same job mix (not timed), so that every size starts busy and
fragmented. Then jobs arrive at an offered load of ~1.3; completions (at each job's expected end) are
released as virtual time passes. Each arrival is placed (a *decision* = one `place` call, plus `commit`
when it fits); when it does not fit, the running job with the earliest end completes and it is tried again
(a refused decision counts too). The cluster therefore stays near full, which is when placement is hardest.
"""

from __future__ import annotations

import heapq
import json
import random
import resource
import statistics
import time
import zlib
from dataclasses import dataclass

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from services.core.scheduler import ClusterState, PendingJob, Placement, RunningJob, schedule_cycle
from shared.domain import (
    JobKind,
    JobSpec,
    NodeSpec,
    PodSet,
    Taint,
    TaintEffect,
    Toleration,
    TopologyLevel,
    TopologyRequest,
)

INFERENCE = Taint(key="pool", value="inference", effect=TaintEffect.NO_SCHEDULE)
TOLERATE = (Toleration(key="pool", value="inference", effect=TaintEffect.NO_SCHEDULE),)
NO_TOLERATIONS: tuple[Toleration, ...] = ()
DATASETS = ("imagenet", "c4", "laion")


def bench_cluster(n_nodes: int, gpus_per_node: int, seed: int = 7) -> list[NodeSpec]:
    """80% H100 training nodes, 10% A100 training, 10% inference pool (tainted); racks of 4, blocks of 8 racks."""
    rng = random.Random(seed)
    groups = (("h100", "H100-80GB", 0.8, ()), ("a100", "A100-80GB", 0.1, ()), ("l40s", "L40S", 0.1, (INFERENCE,)))
    out: list[NodeSpec] = []
    made = 0
    for i, (name, model, share, taints) in enumerate(groups):
        count = n_nodes - made if i == len(groups) - 1 else int(n_nodes * share)
        made += count
        for k in range(count):
            rack = k // 4
            out.append(NodeSpec(
                name=f"{name}-{k}", gpus=gpus_per_node, gpu_model=model, cpu_milli=128_000, memory_mib=1_048_576,
                taints=taints, rack=f"{name}-rack{rack}", block=f"{name}-block{rack // 8}",
                datasets=(rng.choice(DATASETS),) if rng.random() < 0.1 else ()))
    return out


def rng_end(spec: JobSpec) -> float:
    """Warm-up jobs end spread over their runtime (they started before t=0): a deterministic spread."""
    return (zlib.crc32(spec.job_id.encode()) % 1000) / 1000 * spec.max_runtime_s


def bench_jobs(count: int, gpus_per_node: int, seed: int = 11, prefix: str = "job-") -> list[JobSpec]:
    """Mostly 1-GPU jobs, some 2-8 GPUs, a few 16-64-GPU gangs with topology preferences."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        r = rng.random()
        models: tuple[str, ...] = ("H100-80GB",) if rng.random() < 0.8 else ("H100-80GB", "A100-80GB")
        topo = TopologyRequest()
        kind, tolerations = JobKind.TRAINING, NO_TOLERATIONS
        if r < 0.65:
            pods, gpus = 1, 1
        elif r < 0.72:  # inference replicas in their pool
            pods, gpus, models, kind, tolerations = rng.randint(1, 4), 1, ("L40S",), JobKind.INFERENCE, TOLERATE
        elif r < 0.90:
            pods, gpus = 1, rng.choice((2, 4, min(8, gpus_per_node)))
        elif r < 0.98:
            pods, gpus = rng.choice((2, 4)), rng.choice((1, 2))
        else:
            gpus = gpus_per_node
            pods = max(1, rng.choice((16, 32, 64)) // gpus_per_node)
            if rng.random() < 0.7:
                topo = TopologyRequest(preferred_level=TopologyLevel.RACK)
            else:
                topo = TopologyRequest(required_level=TopologyLevel.BLOCK)
        out.append(JobSpec(
            job_id=f"{prefix}{i}", team="bench", queue="bench", kind=kind, topology=topo, tolerations=tolerations,
            pod_sets=(PodSet(name="worker", count=pods, gpus_per_pod=gpus, gpu_models=models,
                             cpu_milli=4000 * gpus, memory_mib=32_768 * gpus),),
            datasets=(rng.choice(DATASETS),) if rng.random() < 0.2 else (),
            max_runtime_s=int(rng.expovariate(1 / 3600)) + 60))
    return out


@dataclass
class BenchResult:
    nodes: int
    gpus: int
    jobs: int
    decisions: int
    placed: int
    refused_then_retried: int
    pods_placed: int
    wall_s: float
    decisions_per_s: float
    pods_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_gpu_utilization: float
    warmup_jobs: int
    build_ms: float
    cycle_200_pending_ms: float
    peak_rss_mib: float


def run_placement_bench(n_nodes: int, gpus_per_node: int, n_jobs: int, strategy: str = "binpack",
                        seed: int = 7, progress: Progress | None = None) -> BenchResult:
    cluster = bench_cluster(n_nodes, gpus_per_node, seed)
    specs = bench_jobs(n_jobs + 200, gpus_per_node, seed + 4)
    t0 = time.perf_counter()
    state = ClusterState.from_nodes(cluster, strategy=strategy)
    build_ms = (time.perf_counter() - t0) * 1000
    total_gpus = int(state.total_gpus)
    running: list[tuple[float, str, int]] = []  # (expected end, job id, gpus) heap
    used = 0
    # Warm-up (not timed): fill the cluster to ~90% with the same mix, so that the timed phase starts
    # on a realistically fragmented, busy cluster whatever its size.
    chunk = 0
    while used < 0.9 * total_gpus:
        for spec in bench_jobs(2000, gpus_per_node, seed + 100 + chunk, prefix=f"warm{chunk}-"):
            got = state.place(spec)
            if isinstance(got, Placement):
                state.commit(got)
                used += got.gpus
                heapq.heappush(running, (rng_end(spec), spec.job_id, got.gpus))
            if used >= 0.9 * total_gpus:
                break
        chunk += 1
    warm_jobs = len(running)
    # Arrivals at offered load ~1.3: completions (expected ends) free what arrivals take.
    mean_gpus = statistics.fmean(s.total_gpus for s in specs) or 1.0
    mean_runtime = statistics.fmean(s.max_runtime_s for s in specs)
    interarrival = mean_runtime * mean_gpus / max(total_gpus, 1) / 1.3  # offered load 1.3
    latencies: list[float] = []
    now = 0.0
    placed = refused = pods = 0
    util_samples: list[float] = []
    task = progress.add_task(f"{n_nodes} nodes", total=n_jobs) if progress else None
    start = time.perf_counter()
    for i, spec in enumerate(specs[:n_jobs]):
        now += interarrival
        while running and running[0][0] <= now:
            _, job_id, gpus = heapq.heappop(running)
            state.release(job_id)
            used -= gpus
        while True:
            t = time.perf_counter()
            got = state.place(spec)
            if isinstance(got, Placement):
                state.commit(got)
                latencies.append(time.perf_counter() - t)
                placed += 1
                pods += len(got.bindings)
                used += got.gpus
                heapq.heappush(running, (now + spec.max_runtime_s, spec.job_id, got.gpus))
                break
            latencies.append(time.perf_counter() - t)
            refused += 1
            if not running:
                break  # can never fit: move on
            now, job_id, gpus = heapq.heappop(running)  # the job waits for the next completion
            state.release(job_id)
            used -= gpus
        if i % 100 == 0:
            util_samples.append(used / total_gpus if total_gpus else 0.0)
        if progress is not None and task is not None and i % 500 == 0:
            progress.update(task, completed=i)
    wall = time.perf_counter() - start
    if progress is not None and task is not None:
        progress.update(task, completed=n_jobs)
    # One backfill cycle over the next 200 jobs on a dry-run copy (what a service cycle costs).
    pending = [PendingJob(s) for s in specs[n_jobs:]]
    run_list = [RunningJob(job_id, end) for end, job_id, _ in running]
    t = time.perf_counter()
    schedule_cycle(state.copy(), pending, run_list, now)
    cycle_ms = (time.perf_counter() - t) * 1000
    lat_ms = sorted(x * 1000 for x in latencies)
    return BenchResult(
        nodes=n_nodes, gpus=total_gpus, jobs=n_jobs, decisions=len(latencies), placed=placed,
        refused_then_retried=refused, pods_placed=pods, wall_s=round(wall, 3),
        decisions_per_s=round(len(latencies) / wall, 1), pods_per_s=round(pods / wall, 1),
        p50_ms=round(statistics.median(lat_ms), 4), p99_ms=round(lat_ms[int(0.99 * (len(lat_ms) - 1))], 4),
        max_ms=round(lat_ms[-1], 3), mean_gpu_utilization=round(statistics.fmean(util_samples or [0.0]), 4),
        warmup_jobs=warm_jobs,         build_ms=round(build_ms, 1), cycle_200_pending_ms=round(cycle_ms, 1),
        peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))


def bench_placement(
    nodes: int = typer.Option(5000, "--nodes", help="Nodes in the simulated cluster."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node."),
    jobs: int = typer.Option(20000, "--jobs", help="Jobs to place (decisions include retries after completions)."),
    strategy: str = typer.Option("binpack", "--strategy", help="binpack (default) or spread."),
    seed: int = typer.Option(7, "--seed", help="Seed of the cluster and workload generators."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as one JSON object."),
) -> None:
    """Placement-core throughput: decisions/s, pods/s, p50/p99 latency per decision, peak RSS.

    The cluster is 80% H100, 10% A100, 10% tainted inference pool (racks of 4 nodes); the workload is
    mostly 1-GPU jobs, some 2-8-GPU jobs, a few 16-64-GPU gangs preferring one rack or requiring one block.
    The cluster is pre-filled to 90% (untimed), then jobs arrive at offered load 1.3 with completions, so
    it churns near full. Latencies are per decision (place + commit); one backfill cycle over 200 pending
    jobs is timed at the end.
    """
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]placing[/bold] {task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=console, transient=as_json) as progress:
        result = run_placement_bench(nodes, gpus_per_node, jobs, strategy, seed, progress)
    figures = result.__dict__
    if as_json:
        print(json.dumps(figures))
        return
    for key, value in figures.items():
        console.print(f"{key:>24}: {value}", highlight=False)
