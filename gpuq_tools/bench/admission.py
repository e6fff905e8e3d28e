"""`gpuq bench admission`: admissions per second of the pure admission core over full cycles.

A synthetic, seeded platform: `--queues` team queues in cohorts of 10, two GPU models, four priority classes,
some StrictFIFO queues and some with max_running_jobs; `--pending` jobs kept waiting. Each measured cycle first
finishes a random `--churn` fraction of the admitted jobs and tops the pending backlog back up (untimed), then
runs `admission_cycle` (timed). Figures: admissions per second over the timed cycles (wall clock, and per
CPU second, which is steadier on a shared machine), p50/p99 of one cycle. The first cycle admits into an
empty cluster (a burst); the others are steady state.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress

from services.core.admission import AdmissionState, Workload, admission_cycle
from shared.config import QueuesConfig, parse_queues
from shared.domain import JobSpec, PodSet

MODELS = ("H100-80GB", "A100-80GB")
CLASSES = ("production", "high", "normal", "low")


def bench_config(queues: int) -> QueuesConfig:
    cohorts = max(1, (queues + 9) // 10)
    return parse_queues({
        "priority_classes": [
            {"name": "production", "value": 1000, "preemptible": False},
            {"name": "high", "value": 500, "preemptible": False},
            {"name": "normal", "value": 100},
            {"name": "low", "value": 0},
        ],
        "cohorts": [{"name": f"cohort-{c:02d}"} for c in range(cohorts)],
        "queues": [
            {
                "name": f"team-{i:03d}",
                "cohort": f"cohort-{i // 10:02d}",
                "weight": 2 if i % 3 == 0 else 1,
                "queueing_strategy": "StrictFIFO" if i % 5 == 0 else "BestEffortFIFO",
                "max_running_jobs": 40 if i % 7 == 0 else None,
                "quotas": {
                    "H100-80GB": {"nominal": 64, "borrowing_limit": 64 if i % 2 else None},
                    "A100-80GB": {"nominal": 32, "lending_limit": 16 if i % 4 == 0 else None},
                },
            }
            for i in range(queues)
        ],
    }, "<bench>")


def random_job(rng: random.Random, n: int, queues: int, t: float) -> Workload:
    q = f"team-{rng.randrange(queues):03d}"
    models = rng.choice(((MODELS[0],), (MODELS[1],), MODELS))
    spec = JobSpec(
        job_id=f"job-{n}",
        team=q,
        queue=q,
        priority_class=rng.choices(CLASSES, weights=(1, 2, 6, 3))[0],
        pod_sets=(PodSet(count=rng.choice((1, 1, 1, 2, 4)), gpus_per_pod=rng.choice((1, 1, 2, 4, 8)),
                         gpu_models=models),),
    )
    return Workload(spec, t)


def run_bench(queues: int, pending: int, cycles: int, churn: float, seed: int, progress: bool = True,
              explain: bool = True, freeze_gc: bool = False, finish: int = 0,
              read_statuses: bool = False) -> dict[str, float | int | bool | None]:
    rng = random.Random(seed)
    state = AdmissionState(bench_config(queues))
    n = 0
    for _ in range(pending):
        state.submit(random_job(rng, n, queues, float(n)))
        n += 1
    # The collector's first full pass over the freshly loaded backlog (about a million objects) happens once
    # in a service's life, right after it loads its state; left in the timed cycles, that one pass would be
    # most of a 30-cycle run. Run it here, untimed, as the service's start-up does.
    gc.collect()
    if freeze_gc:
        # the service also freezes what it loaded (services/admission/app.py), so later full collections
        # never re-scan it
        gc.freeze()
    times: list[float] = []
    cpu: list[float] = []
    gc_time = [0.0, 0.0]  # total, start of the current collection

    def on_gc(phase: str, info: dict[str, Any]) -> None:  # the collector's share of a cycle, reported separately
        if phase == "start":
            gc_time[1] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_time[1]

    gc_in_cycles = 0.0
    admitted: list[int] = []
    statuses: list[int] = []
    read_times: list[float] = []
    now = float(n)
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("admission cycles", total=cycles)
        for c in range(cycles):
            if c:
                running = sorted(state.admitted)
                count = min(finish, len(running)) if finish else int(len(running) * churn)
                for job_id in rng.sample(running, count):
                    state.finish(job_id)
                while len(state.pending) < pending:
                    state.submit(random_job(rng, n, queues, now))
                    n += 1
            now += 1.0
            gc_time[0] = 0.0
            gc.callbacks.append(on_gc)
            t0, c0 = time.perf_counter(), time.process_time()
            decision = admission_cycle(state, now, explain=explain)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            gc.callbacks.remove(on_gc)
            gc_in_cycles += gc_time[0]
            admitted.append(len(decision.admitted))
            statuses.append(len(decision.pending))
            if read_statuses:  # what the service does after a cycle: walk every status once (timed apart)
                r0 = time.perf_counter()
                walked = sum(1 for _ in decision.pending.items())
                read_times.append(time.perf_counter() - r0)
                assert walked == statuses[-1]
            bar.advance(task)
    total = sum(times)
    steady = times[1:] or times
    steady_admitted = admitted[1:] or admitted
    return {
        "queues": queues,
        "pending": pending,
        "cycles": cycles,
        "churn": churn,
        "finish_per_cycle": finish,
        "explain": explain,
        "freeze_gc": freeze_gc,
        "admitted_total": sum(admitted),
        "admissions_per_s": round(sum(admitted) / total, 1),
        "admissions_per_cpu_s": round(sum(admitted) / sum(cpu), 1),
        "steady_admissions_per_s": round(sum(steady_admitted) / sum(steady), 1),
        "mean_admitted_per_cycle": round(statistics.fmean(steady_admitted), 1),
        "first_cycle_admitted": admitted[0],
        "first_cycle_ms": round(times[0] * 1000, 2),
        "cycle_p50_ms": round(_percentile(steady, 50) * 1000, 2),  # steady cycles (the first is a burst)
        "cycle_p99_ms": round(_percentile(steady, 99) * 1000, 2),
        "gc_share_of_cycles": round(gc_in_cycles / total, 3),
        "statuses_per_cycle": round(statistics.fmean(statuses)),
        # reading every status after a cycle (PendingStatus objects and positions, built when read)
        "read_all_statuses_p50_ms": round(_percentile(read_times, 50) * 1000, 2) if read_times else None,
    }


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def bench_admission(
    queues: int = typer.Option(100, help="Team queues (grouped in cohorts of 10)."),
    pending: int = typer.Option(50_000, help="Pending jobs kept in the backlog every cycle."),
    cycles: int = typer.Option(30, help="Admission cycles to time."),
    churn: float = typer.Option(0.1, help="Fraction of admitted jobs finished before each cycle."),
    finish: int = typer.Option(0, help="Instead of --churn: this many admitted jobs finish before each cycle "
                               "(event-driven cycles; unchanged cohorts are then reused)."),
    seed: int = typer.Option(1, help="Random seed (same seed, same workload)."),
    explain: bool = typer.Option(True, "--explain/--no-explain",
                                 help="Build a PendingStatus for every pending job (a full cycle) or skip it."),
    freeze_gc: bool = typer.Option(False, "--freeze-gc", help="gc.freeze() after loading the backlog, as a "
                                   "long-lived service would (full collections then skip the loaded jobs)."),
    read_statuses: bool = typer.Option(False, "--read-statuses", help="After each cycle, also read every "
                                       "pending job's status (as the service does), timed apart from the cycle."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as one JSON object."),
) -> None:
    """Admissions per second of the admission core over full cycles, and the p99 time of one cycle."""
    result = run_bench(queues, pending, cycles, churn, seed, progress=not as_json, explain=explain,
                       freeze_gc=freeze_gc, finish=finish, read_statuses=read_statuses)
    if as_json:
        typer.echo(json.dumps(result))
        return
    console = Console()
    for k, v in result.items():
        console.print(f"{k:>26}: {v}")
