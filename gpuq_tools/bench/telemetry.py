"""`gpuq bench telemetry`: how fast the core folds events and how long one scrape takes on a big cluster."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import typer
from rich.console import Console
from rich.progress import Progress

from services.core.telemetry.state import TelemetryState
from services.telemetry.metrics import TelemetryMetrics
from shared.domain import GpuBinding, JobSpec, NodeSpec, PodSet
from shared.events import (
    GpuSample,
    JobAdmitted,
    JobCompleted,
    JobPending,
    JobPlaced,
    JobStarted,
    JobSubmitted,
    NodeInventory,
    Payload,
    UtilizationSampled,
)

T0 = 1_767_225_600.0


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(T0 + t, tz=UTC)


def bench_telemetry(
    nodes: int = typer.Option(512, help="Nodes of 8 GPUs each."),
    jobs: int = typer.Option(4000, help="Jobs to run through their lifecycle (about half stay waiting)."),
    scrapes: int = typer.Option(5, help="Scrapes (gauge snapshot + exposition) to time."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """Fold a synthetic event stream into the telemetry core, then time full scrapes of /metrics."""
    state = TelemetryState()
    metrics = TelemetryMetrics(lambda: state.gauges(T0 + 100))
    inventory = tuple(NodeSpec(name=f"n{i:04d}", gpus=8, gpu_model="H100", cpu_milli=1, memory_mib=1,
                               labels={"pool": "training"}, rack=f"r{i // 8}", block=f"b{i // 64}")
                      for i in range(nodes))
    state.apply(NodeInventory(nodes=inventory), T0)
    events = 0
    fold_s = 0.0
    free = [(n.name, g) for n in inventory for g in range(8)]
    with Progress(transient=True) as progress:
        task = progress.add_task("folding events", total=jobs)
        for j in range(jobs):
            spec = JobSpec(job_id=f"j{j:05d}", team=f"team-{j % 12}", queue=f"team-{j % 12}",
                           pod_sets=(PodSet(count=1, gpus_per_pod=2),), labels={"feature": f"f{j % 7}"})
            batch: list[Payload] = [JobSubmitted(spec=spec, submitted_at=_dt(0)),
                           JobPending(job_id=spec.job_id, queue=spec.queue, reason="QuotaExhausted", message="",
                                      position_in_queue=j, eta=_dt(3600))]
            if len(free) >= 2 and j % 2 == 0:
                (n0, g0), (n1, g1) = free.pop(), free.pop()
                binds = (GpuBinding(pod="main-0", node=n0, gpu_indices=(g0,)),
                         GpuBinding(pod="main-1", node=n1, gpu_indices=(g1,)))
                batch += [JobAdmitted(job_id=spec.job_id, spec=spec, admitted_at=_dt(10)),
                          JobPlaced(job_id=spec.job_id, spec=spec, bindings=binds, placed_at=_dt(11)),
                          JobStarted(job_id=spec.job_id, started_at=_dt(12))]
                if j % 10 == 0:
                    batch.append(JobCompleted(job_id=spec.job_id, finished_at=_dt(50)))
            start = time.perf_counter()
            for p in batch:
                metrics.record(state.apply(p, T0 + 20).observations)
            fold_s += time.perf_counter() - start
            events += len(batch)
            progress.advance(task)
        for n in inventory:
            sample = UtilizationSampled(node=n.name, gpu_model="H100", sampled_at=_dt(90), interval_s=30,
                                        samples=tuple(GpuSample(gpu_index=g, utilization_pct=50.0) for g in range(8)))
            start = time.perf_counter()
            metrics.record(state.apply(sample, T0 + 90).observations)
            fold_s += time.perf_counter() - start
            events += 1
    timings = []
    size = 0
    for _ in range(scrapes):
        start = time.perf_counter()
        size = len(metrics.render())
        timings.append(time.perf_counter() - start)
    metrics.shutdown()
    figures = {"nodes": nodes, "gpus": nodes * 8, "jobs": jobs, "events": events,
               "events_per_s": round(events / fold_s) if fold_s else None,
               "scrape_s_median": round(sorted(timings)[len(timings) // 2], 4),
               "scrape_bytes": size, "live_jobs": len(state.jobs)}
    if as_json:
        typer.echo(json.dumps(figures))
        return
    console = Console()
    for k, v in figures.items():
        console.print(f"{k:>16}: {v}")
