"""`gpuq simulate`: replay a trace in virtual time under one or more policies.

The simulator's numbers and plots need numpy and matplotlib, the optional extra `gpuq[sim]` that the service image
leaves out: this module imports neither (nor what imports them) until the command runs, so `gpuq` and
`gpuq simulate --help` work without them, and the command says how to install them.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shared.config import ConfigError
from sim.loaders import TraceError
from sim.policies import POLICIES

if TYPE_CHECKING:
    from sim.failures import NodeFailure
    from sim.model import Trace
    from sim.run import PolicyRun

# What `gpuq simulate` needs beyond the service's dependencies (pyproject.toml, extra `sim`).
SIM_EXTRA = ("numpy", "matplotlib")
INSTALL_HINT = "pip install 'gpuq[sim]'"


# Below this offered load jobs barely wait for each other: every policy admits at once and the comparison says
# nothing (the whole Philly trace on its own cluster runs at about 0.02).
LOW_LOAD = 0.3


def low_load_warning(offered: float) -> str | None:
    """One line for stderr when the trace cannot tell policies apart, with the options that raise the load."""
    if offered >= LOW_LOAD:
        return None
    return (f"offered load {offered:.2f} is below {LOW_LOAD}: jobs barely wait, so every policy gives about the same "
            "result; raise it with --load 0.9 (the cluster scaled to fit), --month or --arrival-scale")


def missing_sim_extra() -> list[str]:
    """The simulator's libraries that cannot be imported here (without importing them: matplotlib is slow)."""
    missing = []
    for name in SIM_EXTRA:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a finder that refuses it
            found = False
        if not found:
            missing.append(name)
    return missing


def simulate(
    trace: Path = typer.Option(..., "--trace", help="Trace file: generic CSV "
                               "(job_id,submit_time,duration,gpus,team[,priority_class,gpu_model,max_runtime_s]), "
                               "philly.csv or the openb pod list (detected from the header)."),
    cluster: Path | None = typer.Option(None, "--cluster", help="cluster.yaml (required for the generic CSV; "
                                        "Philly and openb build their own cluster when omitted)."),
    queues: Path | None = typer.Option(None, "--queues", help="queues.yaml (default: one queue per team; Philly: "
                                       "VC quotas from philly_vc.csv). A changed queues.yaml is a what-if."),
    policy: str = typer.Option("gpuq,quota-fifo,pod-fifo", "--policy",
                               help=f"Comma-separated policies among {', '.join(POLICIES)}."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here ('-' = stdout)."),
    report: Path | None = typer.Option(None, "--report", help="Write report.md and PNG plots into this folder."),
    fmt: str = typer.Option("auto", "--format", help="auto | generic | philly | openb."),
    start: str | None = typer.Option(None, "--start", help="Keep submissions from this time (ISO date or "
                                     "seconds, in the trace's clock)."),
    end: str | None = typer.Option(None, "--end", help="Keep submissions before this time."),
    month: str | None = typer.Option(None, "--month", help="Keep one month of submissions, e.g. 2017-10."),
    cluster_scale: float = typer.Option(1.0, "--cluster-scale", help="Multiply node counts and quotas."),
    load: float | None = typer.Option(None, "--load", help="Scale the cluster (and quotas) so the offered load "
                                      "≈ this value (GPU-seconds asked ÷ capacity × submission span)."),
    arrival_scale: float = typer.Option(1.0, "--arrival-scale", help="Compress inter-arrival times by this factor."),
    topology: Path | None = typer.Option(None, "--topology", help="host,rack,block or ip,DSW,PSW,ASW CSV "
                                         "(e.g. lingjun_topo.csv) overriding the generated topology."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthesised estimates and priority classes."),
    max_jobs: int | None = typer.Option(None, "--max-jobs", help="Replay only the first N jobs of the window."),
    gpu_sharing: str = typer.Option("round", "--gpu-sharing", help="openb's fractional pods: 'round' (half-GPU "
                                    "slices or whole GPUs, the old replay), or replayed as fractions on nodes "
                                    "sharing their GPUs by 'time-slicing' or 'mps'."),
    write_queues: Path | None = typer.Option(None, "--write-queues", help="Also write the queues the replay "
                                             "used as a queues.yaml (a starting point for a what-if)."),
    node_mtbf_h: float | None = typer.Option(None, "--node-mtbf-h", help="Fail nodes: mean hours between one "
                                             "node's failures (exponential, seeded by --seed; same for every "
                                             "policy). A failure stops the node's jobs, which lose the work "
                                             "since their last checkpoint and wait again."),
    node_repair_h: float = typer.Option(2.0, "--node-repair-h", help="Mean hours a failed node stays down."),
    spot_mtbi_h: float | None = typer.Option(None, "--spot-mtbi-h", help="Interrupt spot nodes: mean hours "
                                             "between one spot node's interruptions (seeded by --seed)."),
    spot_share: float = typer.Option(0.5, "--spot-share", help="Share of the nodes that are spot (when no node "
                                     "is labelled gpuq.io/spot=true)."),
    spot_notice_s: int = typer.Option(120, "--spot-notice-s", help="Interruption notice, seconds (0: none): "
                                      "jobs there are asked for a checkpoint at once."),
    spot_checkpoint_s: int = typer.Option(60, "--spot-checkpoint-s", help="Seconds a job takes to write the "
                                          "checkpoint asked for on a notice."),
    spot_replace_h: float = typer.Option(0.25, "--spot-replace-h", help="Mean hours until a replacement "
                                         "spot node is up."),
    eta: str = typer.Option("off", "--eta", help="Give waiting jobs ETAs with the production ETA code (gpuq "
                            "policies) and report their accuracy (eta_* in the JSON): 'predicted' (predicted "
                            "durations, calibrated range), 'limits' (every job runs its whole limit: the old "
                            "ETA) or 'off'. Slower: each refresh replays the queue."),
    eta_range: str = typer.Option("replays", "--eta-range", help="The ETA range: 'replays' (p10 / p90 replays) or "
                                  "'calibrated' (the median replay alone, the record's error quantiles)."),
) -> None:
    """Replay a GPU job trace through the same cores as production and compare policies."""
    console = Console(stderr=True)
    missing = missing_sim_extra()
    if missing:
        console.print(f"[red]error:[/] gpuq simulate needs the simulator's extra ({', '.join(missing)} not "
                      f"installed): {escape(INSTALL_HINT)}", soft_wrap=True)
        raise typer.Exit(2)
    from sim.run import TraceOptions, load_trace

    names = [p.strip() for p in policy.split(",") if p.strip()]
    opts = TraceOptions(trace=trace, fmt=fmt, cluster=cluster, queues=queues, start=start, end=end, month=month,
                        cluster_scale=cluster_scale, load=load, arrival_scale=arrival_scale, topology=topology,
                        seed=seed, max_jobs=max_jobs, gpu_sharing=gpu_sharing)
    try:
        _check_policies(names, gpu_sharing)
        tr = load_trace(opts)
        console.print(f"[bold]{tr.name}[/]: {len(tr.jobs):,} jobs, {len(tr.nodes):,} nodes, "
                      f"{tr.capacity_gpus:,} GPUs, offered load {tr.offered_load():.2f}")
        warning = low_load_warning(tr.offered_load())
        if warning is not None:
            console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
        failures = _failures(console, tr, seed, node_mtbf_h, node_repair_h, spot_mtbi_h, spot_share, spot_notice_s,
                             spot_checkpoint_s, spot_replace_h)
        runs = _run_with_progress(console, tr, names, failures, eta, eta_range)
    except (TraceError, ConfigError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    _write_results(console, tr, runs, write_queues, json_out, report)


def _check_policies(names: list[str], gpu_sharing: str) -> None:
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise TraceError(f"unknown policy {', '.join(unknown) or '(none)'}; choose from {', '.join(POLICIES)}")
    rounding = [n for n in names if not n.startswith("gpuq") and n != "volcano-hami"]
    if gpu_sharing != "round" and rounding:
        raise TraceError(f"--gpu-sharing {gpu_sharing}: {', '.join(rounding)} cannot share a GPU; replay them "
                         "with --gpu-sharing round (fractions rounded up), or compare with volcano-hami")


def _failures(console: Console, tr: Trace, seed: int, node_mtbf_h: float | None, node_repair_h: float,
              spot_mtbi_h: float | None, spot_share: float, spot_notice_s: int, spot_checkpoint_s: int,
              spot_replace_h: float) -> list[NodeFailure]:
    """The node failures (--node-mtbf-h) and spot interruptions (--spot-mtbi-h) every policy replays alike."""
    from sim.run import node_failures

    failures = node_failures(tr, node_mtbf_h, node_repair_h, seed)
    if failures:
        console.print(f"{len(failures):,} node failures (mean {node_mtbf_h} h between failures per node, "
                      f"{node_repair_h} h repair)")
    if spot_mtbi_h is not None:
        from sim.failures import spot_nodes, synth_spot_interruptions

        horizon = float(tr.jobs[-1].submit_time) if tr.jobs else 0.0
        try:
            spot = spot_nodes(tr.nodes, spot_share, seed)
            interruptions = synth_spot_interruptions(spot, horizon, spot_mtbi_h, spot_replace_h,
                                                     spot_notice_s, spot_checkpoint_s, seed)
        except ValueError as exc:
            raise TraceError(str(exc).replace("--node-mtbf-h", "--spot-mtbi-h")) from None
        console.print(f"{len(interruptions):,} spot interruptions of {len(spot):,} spot nodes (mean "
                      f"{spot_mtbi_h} h apart per node, {spot_notice_s} s notice)")
        failures = sorted([*failures, *interruptions])
    return failures


def _run_with_progress(console: Console, tr: Trace, names: list[str], failures: list[NodeFailure],
                       eta: str, eta_range: str = "replays") -> list[PolicyRun]:
    """Every policy over the trace, one progress bar each."""
    from sim.run import run_policies

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        tasks = {n: progress.add_task(f"{n:>10}", total=len(tr.jobs)) for n in names}
        last: dict[str, int] = dict.fromkeys(names, -1)
        step = max(1, len(tr.jobs) // 200)

        def tick(name: str, done: int) -> None:
            if done - last[name] >= step or done == len(tr.jobs):  # throttle: repainting is not free
                last[name] = done
                progress.update(tasks[name], completed=done)

        return run_policies(tr, names, progress=tick, failures=failures, eta=eta, eta_range=eta_range)


def _write_results(console: Console, tr: Trace, runs: list[PolicyRun], write_queues: Path | None,
                   json_out: Path | None, report: Path | None) -> None:
    """The table, and what was asked for: the queues used, the JSON, the report with its plots."""
    from sim.run import queues_yaml, trace_summary

    doc = {"trace": trace_summary(tr), "results": [r.metrics for r in runs]}
    if write_queues is not None:
        write_queues.write_text(queues_yaml(tr))
        console.print(f"queues written to {write_queues}")
    _print_table(console, runs)
    if json_out is not None:
        text = json.dumps(doc, indent=2, sort_keys=False)
        if str(json_out) == "-":
            sys.stdout.write(text + "\n")
        else:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(text + "\n")
            console.print(f"results written to {json_out}")
    if report is not None:
        from sim.report import write_report

        files = write_report(runs, report, command="gpuq simulate " + shlex.join(sys.argv[2:]))
        console.print(f"report written: {', '.join(str(f) for f in files)}")


def _print_table(console: Console, runs: list[PolicyRun]) -> None:
    keys = ("completed", "avg_jct_s", "p50_wait_s", "p99_wait_s", "gpu_utilization", "busy_gpu_utilization",
            "idle_partial_gang_gpu_hours", "jain_fairness", "themis_rho_worst", "fragmentation_avg_gpus",
            "sim_wall_s", "events_per_s")
    table = Table(title="simulation results")
    table.add_column("metric")
    for r in runs:
        table.add_column(r.metrics["policy"], justify="right")
    extra = [k for k in ("preemptions", "lost_gpu_hours", "node_failures", "jobs_stopped_by_node_failures",
                         "failure_lost_gpu_hours") if any(r.metrics.get(k) for r in runs)]  # only when they happened
    for k in (*keys[:-2], *extra, *keys[-2:]):
        table.add_row(k, *[f"{r.metrics[k]:,}" for r in runs])
    if any(r.metrics.get("lost_gpu_hours") or r.metrics.get("failure_lost_gpu_hours") for r in runs):
        for cause in runs[0].metrics["lost_gpu_hours_by_cause"]:  # lost work per cause, when any was lost
            table.add_row(f"lost:{cause}", *[f"{r.metrics['lost_gpu_hours_by_cause'][cause]:,}" for r in runs])
        table.add_row("lost_work_share", *[f"{r.metrics['lost_work_share']:.3%}" for r in runs])
    console.print(table)
