"""`gpuq bench eta`: the wall time of one ETA refresh of the admission service (services/eta/platform.py:
`PlatformEta`, the call the service makes) with a deep queue.

A synthetic, seeded platform: `--nodes` nodes of 8 GPUs (one model), `--queues` team queues in one cohort with equal
quotas, the cluster filled with running jobs (admitted and placed, not timed), then `--waiting` jobs submitted (1-8
GPUs, run times of minutes to a day, limits 1-4x the run time) and an admission cycle run, so that some wait
admitted and most wait pending, as on a platform with a deep queue. The ETA model first learns the run times of
`--history` finished jobs, and as many ETAs given against the starts that followed (its calibration record, full as
on a running platform: every ETA shown is widened by its margins). A first refresh (reported apart, `first_s`) also
learns every waiting job's arrival; then each of `--runs` timed refreshes is one `PlatformEta.__call__` (the
arrivals seen, the replays, the ETAs remembered) on the same state a minute later, as the service refreshes when
nothing changed, with the refresh's work budget (`--budget`: job-cycles per refresh,
`services.core.eta.DEFAULT_BUDGET`) and its range method (`--range-method`: the p10 and p90 replays, or the
median replay alone with the record's error quantiles); the figure is the median wall time.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
from typing import Any

import typer

from services.core.admission import AdmissionState, Workload, admission_cycle
from services.core.eta import DEFAULT_BUDGET, RANGE_METHODS, EtaModel, EtaRange
from services.core.scheduler import ClusterState, PendingJob, schedule_cycle
from services.eta.platform import PlatformEta
from shared.config import ClusterConfig, NodeGroup
from shared.domain import JobSpec, PodSet
from sim.loaders import queues_for_teams

MODEL = "H100"


def _spec(rng: random.Random, n: int, queues: int) -> tuple[JobSpec, float]:
    team = f"team-{rng.randrange(queues):02d}"
    gpus = rng.choice((1, 1, 1, 2, 4, 8))
    run_s = rng.choice((600, 1800, 3600, 4 * 3600, 12 * 3600, 86_400))
    spec = JobSpec(job_id=f"job-{n}", team=team, queue=team,
                   priority_class=rng.choices(("high", "normal", "low"), weights=(1, 6, 3))[0],
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus, gpu_models=(MODEL,)),),
                   max_runtime_s=run_s * rng.choice((1, 2, 4)))
    return spec, float(run_s)


def build_platform(nodes: int, queues: int, waiting: int, history: int, seed: int, range_method: str = "replays"
                   ) -> tuple[ClusterState, AdmissionState, dict[str, float], EtaModel, float]:
    """(cluster, admission state, reserved ends of the running jobs, a model that learnt `history` run times,
    now): a full cluster and `waiting` jobs waiting."""
    rng = random.Random(seed)
    now = 100_000.0
    node_specs = ClusterConfig(node_groups=(NodeGroup(name="n", count=nodes, gpus_per_node=8, gpu_model=MODEL,
                                                      cpu_milli=96_000, memory_mib=1_048_576),)).nodes()
    cluster = ClusterState.from_nodes(node_specs)
    teams = [f"team-{i:02d}" for i in range(queues)]
    adm = AdmissionState(queues_for_teams(teams, {MODEL: nodes * 8}))
    model = EtaModel(range_method=range_method)
    scored = random.Random(seed + 1)  # (its own stream: the platform is the one the seed always gave)
    for i in range(history):
        spec, run_s = _spec(rng, i, queues)
        model.job_finished(spec.model_copy(update={"job_id": f"old-{i}"}), run_s * rng.uniform(0.5, 1.5))
        # what a running platform's calibration record holds: ETAs given and the starts that followed, so each
        # refresh widens its ranges by the record's margins, as the service does
        given_at = now - 86_400.0 + 30.0 * i
        planned = given_at + scored.uniform(60, 7_200)
        model.job_started(spec.queue, given_at, EtaRange(planned, given_at + (planned - given_at) / 2,
                                                         given_at + (planned - given_at) * 2),
                          given_at + (planned - given_at) * scored.uniform(0.3, 3.0),
                          given_at - scored.choice((0.0, 600.0)))
    n = 0
    reserved: dict[str, float] = {}
    # fill the cluster: submit, admit, place until nothing more fits (not timed)
    for _round in range(50):
        for _ in range(nodes * 2):
            spec, _run = _spec(rng, n, queues)
            adm.submit(Workload(spec=spec, submitted_at=now - rng.uniform(3600, 7200)))
            n += 1
        decision = admission_cycle(adm, now - 3600, capacity=cluster.free_gpus_by_model())
        result = schedule_cycle(cluster, [PendingJob(spec=a.spec) for a in decision.admitted], [], now - 3600)
        placed = {p.job_id for p in result.placed}
        for p in result.placed:
            started = now - rng.uniform(0, 3600)
            reserved[p.job_id] = started + adm.admitted[p.job_id].spec.max_runtime_s
        for a in decision.admitted:
            if a.spec.job_id not in placed:
                adm.finish(a.spec.job_id)  # (admitted but did not fit: dropped, the cluster is full)
        for job_id in list(adm.pending):
            adm.finish(job_id)
        if not result.placed:
            break
    for _ in range(waiting):
        spec, _run = _spec(rng, n, queues)
        adm.submit(Workload(spec=spec, submitted_at=now - rng.uniform(0, 3600)))
        n += 1
    admission_cycle(adm, now, capacity=cluster.free_gpus_by_model())
    return cluster, adm, reserved, model, now


def run_bench(nodes: int, queues: int, waiting: int, history: int, runs: int, budget: int | None,
              seed: int, range_method: str = "replays") -> dict[str, Any]:
    cluster, adm, reserved, model, now = build_platform(nodes, queues, waiting, history, seed, range_method)
    # the admission service freezes what it loaded (services/admission/app.py): full collections never re-scan it
    gc.collect()
    gc.freeze()
    eta = PlatformEta(model=model, budget=budget)
    t0 = time.perf_counter()
    eta(cluster, adm, reserved, now)  # the first refresh also learns every waiting job's arrival (not timed)
    first = time.perf_counter() - t0
    times: list[float] = []
    cpu: list[float] = []  # (CPU seconds: steadier than wall time on a shared machine)
    given = 0
    for i in range(1, runs + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        etas = eta(cluster, adm, reserved, now + 60.0 * i)  # a minute later each, nothing else changed
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        given = len(etas)
    waiting_now = len(adm.pending) + sum(1 for j in adm.admitted if j not in reserved)
    return {"nodes": nodes, "gpus": nodes * 8, "running": len(reserved), "waiting": waiting_now,
            "budget": budget, "runs": runs, "etas_given": given, "median_s": round(statistics.median(times), 3),
            "min_s": round(min(times), 3), "max_s": round(max(times), 3), "first_s": round(first, 3),
            "median_cpu_s": round(statistics.median(cpu), 3), "range_method": range_method}


def bench_eta(
    waiting: int = typer.Option(20_000, help="Jobs waiting (pending and admitted-unplaced)"),
    nodes: int = typer.Option(160, help="Nodes of 8 GPUs, all busy"),
    queues: int = typer.Option(10, help="Team queues, one cohort, equal quotas"),
    history: int = typer.Option(2_000, help="Finished jobs the ETA model learnt run times from"),
    runs: int = typer.Option(5, help="Timed refreshes (the median is reported)"),
    budget: int = typer.Option(DEFAULT_BUDGET, help="The refresh's work budget (replay events); 0: none, the "
                                                    "whole queue replayed exactly"),
    seed: int = typer.Option(7),
    range_method: str = typer.Option("replays", "--range-method", help="How the ETA's range is made: 'replays' "
                                     "(three replays a refresh) or 'calibrated' (the median replay alone)"),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a line"),
) -> None:
    """Wall time of one ETA refresh with a deep queue (PlatformEta: the replays and the calibration)."""
    if waiting < 0 or nodes < 1 or queues < 1 or runs < 1 or budget < 0:
        raise typer.BadParameter("need --waiting >= 0, --nodes >= 1, --queues >= 1, --runs >= 1, --budget >= 0")
    if range_method not in RANGE_METHODS:
        raise typer.BadParameter(f"--range-method: one of {', '.join(RANGE_METHODS)}")
    out = run_bench(nodes, queues, waiting, history, runs, budget or None, seed, range_method)
    if as_json:
        typer.echo(json.dumps(out, sort_keys=True))
    else:
        typer.echo(f"ETA refresh: {out['waiting']} waiting, {out['running']} running on {out['gpus']} GPUs, "
                   f"budget {out['budget']}: median {out['median_s']} s (CPU {out['median_cpu_s']} s) over {runs} runs "
                   f"(min {out['min_s']} s, "
                   f"max {out['max_s']} s; first refresh {out['first_s']} s), {out['etas_given']} ETAs")
