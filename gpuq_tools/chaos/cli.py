"""`gpuq chaos`: the chaos harness as a command, with bigger settings, for an operator's soak run."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
from pathlib import Path

import typer
from rich.console import Console

from gpuq_tools.chaos.harness import FAULTS, ChaosSettings, run_chaos

console = Console()


def chaos(
    jobs: int = typer.Option(1000, help="Jobs to submit (1-GPU to --max-gpus, single pod)"),
    nodes: int = typer.Option(16, help="Simulated nodes of 8 H100 each"),
    arrival_window: float = typer.Option(300.0, help="Seconds over which the jobs are submitted"),
    max_duration: float = typer.Option(30.0, help="Longest simulated job duration, seconds (the shortest is 2)"),
    max_gpus: int = typer.Option(4, help="Most GPUs per job"),
    faults: str = typer.Option(",".join(FAULTS), help="Comma-separated faults, in order: " + ", ".join(FAULTS)),
    rounds: int = typer.Option(3, min=1, help="How many times the fault sequence is repeated"),
    lease_ttl: float = typer.Option(10.0, help="The services' GPUQ_LEASE_TTL_S (a pause lasts longer than this)"),
    deadline: float = typer.Option(900.0, help="Seconds each fault may take to recover, and the jobs to finish"),
    workdir: Path | None = typer.Option(
        None, help="Where servers' data and the services' logs go (default: a temporary directory, removed at the "
                   "end unless --keep)"),
    keep: bool = typer.Option(False, help="Keep the temporary working directory (logs) after the run"),
    seed: int = typer.Option(17, help="Seed of the generated workload"),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON"),
) -> None:
    """Soak the platform under faults: start NATS, Postgres and one `gpuq up` process per service (plus a standby
    scheduler) of its own, submit jobs, kill and restart each service process, NATS and Postgres, pause the active
    scheduler past its lease, then check the invariants (one terminal state per job, no GPU held twice, quota
    within what admission grants, the metering ledger equal to the executor's, nothing stuck, no dead letters but
    the injected ones). Prints each fault's recovery time. Touches nothing but what it starts; exit code 1 when an
    invariant broke or a fault did not recover."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = [f.strip() for f in faults.split(",") if f.strip()]
    try:
        settings = ChaosSettings(jobs=jobs, nodes=nodes, arrival_window_s=arrival_window, max_duration_s=max_duration,
                                 max_gpus=max_gpus, faults=tuple(names) * rounds, lease_ttl_s=lease_ttl,
                                 deadline_s=deadline, seed=seed)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    where = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix="gpuq-chaos-"))
    where.mkdir(parents=True, exist_ok=True)
    console.print(f"gpuq chaos: working in {where}")
    try:
        with console.status("chaos: running (faults and recoveries are printed as they happen)"):
            report = asyncio.run(run_chaos(settings, where, say=console.print))
    finally:
        if workdir is None and not keep:
            shutil.rmtree(where, ignore_errors=True)  # the temporary directory this command created
    if as_json:
        console.print_json(json.dumps(report.as_dict()))
    else:
        console.print(f"jobs {report.terminal}/{report.submitted} terminal, {report.events} job events, "
                      f"{report.dead_letters} dead letters (injected), {report.wall_s:.0f} s")
        for fault in report.faults:
            shown = f"{fault.recovery_s:.1f} s" if fault.recovery_s is not None else "[red]not recovered[/]"
            takeover = f" (standby led {fault.takeover_s:.1f} s after it)" if fault.takeover_s is not None else ""
            console.print(f"  {fault.fault:<20} {fault.process:<18} {shown}{takeover}")
        for violation in report.violations:
            console.print(f"[red]violation:[/] {violation}")
        console.print("[green]all invariants held[/]" if report.ok else "[red]FAILED[/]")
    if not report.ok:
        raise typer.Exit(1)
