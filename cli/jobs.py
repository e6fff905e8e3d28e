"""Users' commands: submit, status, explain, queues, cancel."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import nats
import typer
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from cli.runtime import database_url, nats_url
from cli.status import explain_lines, fetch_status, fmt_time, wait_seconds
from shared.domain import JobSpec, PodSet, TopologyLevel, TopologyRequest
from shared.events import JobCancelled, JobSubmitted
from shared.service import publish_event
from shared.tracing import command_span, traced_event

console = Console()


def _specs_from_file(path: Path) -> list[JobSpec]:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"{path}: {exc}", param_hint="FILE") from None
    items: list[Any] = doc if isinstance(doc, list) else (
        list(doc["jobs"] or []) if isinstance(doc, dict) and "jobs" in doc else [doc])
    specs = []
    for i, item in enumerate(items):
        try:
            specs.append(JobSpec.model_validate(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise typer.BadParameter(f"{path}: job {i}: {where}: {first['msg']}", param_hint="FILE") from None
    return specs


async def _publish(specs: list[JobSpec]) -> None:
    nc = await nats.connect(nats_url(), connect_timeout=5)
    try:
        js = nc.jetstream()
        now = datetime.now(UTC)
        for spec in specs:
            with command_span(f"gpuq submit {spec.job_id}"):  # the job's trace starts here
                await publish_event(js, traced_event(JobSubmitted(spec=spec, submitted_at=now), source="gpuq-cli",
                                                     time=now), JobSubmitted.subject())
    finally:
        await nc.close()


def submit(
    file: Path | None = typer.Argument(None, help="A job spec (YAML/JSON), a list of them, or {jobs: [...]}"),
    team: str | None = typer.Option(None, help="Team submitting the job (with no FILE)"),
    queue: str | None = typer.Option(None, help="Queue to submit to (default: the team's name)"),
    gpus: int = typer.Option(1, help="GPUs per pod"),
    pods: int = typer.Option(1, help="Pods in the gang"),
    gpu_model: list[str] = typer.Option([], "--gpu-model", help="Acceptable GPU model (repeat for any-of)"),
    priority: str = typer.Option("normal", help="Priority class"),
    max_runtime: int = typer.Option(3600, help="The job's runtime limit / estimate in seconds"),
    rack: bool = typer.Option(False, help="Require the whole gang inside one rack"),
    name: str | None = typer.Option(None, help="Job id (default: generated)"),
    label: list[str] = typer.Option([], help="key=value label for cost attribution (repeatable)"),
) -> None:
    """Submit jobs by publishing JobSubmitted events (what ML pipelines do too)."""
    if file is not None:
        specs = _specs_from_file(file)
    else:
        if team is None:
            raise typer.BadParameter("give a FILE or at least --team", param_hint="--team")
        labels = dict(item.split("=", 1) for item in label if "=" in item)
        try:
            specs = [JobSpec(
                job_id=name or f"{team}-{uuid.uuid4().hex[:8]}", team=team, queue=queue or team,
                priority_class=priority, max_runtime_s=max_runtime, labels=labels,
                pod_sets=(PodSet(count=pods, gpus_per_pod=gpus, gpu_models=tuple(gpu_model)),),
                topology=TopologyRequest(required_level=TopologyLevel.RACK) if rack else TopologyRequest())]
        except ValidationError as exc:
            raise typer.BadParameter(str(exc)) from None
    asyncio.run(_publish(specs))
    for spec in specs:
        console.print(f"submitted [bold]{spec.job_id}[/] to queue {spec.queue} ({spec.total_gpus} GPU)")


STATE_STYLE = {"completed": "green", "running": "cyan", "placed": "cyan", "pending": "yellow", "admitted": "yellow",
               "rejected": "red", "failed": "red", "cancelled": "magenta"}


def status(
    job_id: str | None = typer.Argument(None, help="One job's id"),
    all_jobs: bool = typer.Option(False, "--all", help="Every job, not only active ones"),
    output: str = typer.Option("table", "--format", help="table or json"),
    limit: int = typer.Option(200, help="At most this many rows"),
) -> None:
    """Where jobs are: pending, admitted, running, completed, failed, rejected."""
    rows = asyncio.run(fetch_status(database_url(), job_id, limit=None if job_id else limit * 50))
    if job_id and not rows:
        console.print(f"[red]no job {job_id!r}[/]")
        raise typer.Exit(1)
    if not job_id and not all_jobs:
        rows = [r for r in rows if r["state"] in ("pending", "admitted", "placed", "running")]
    rows = rows[-limit:]
    if output == "json":
        typer.echo(json.dumps([_public(r) for r in rows], indent=2, default=str))
        return
    now = time.time()
    table = Table(title=f"{len(rows)} job(s)")
    for col in ("job", "team", "queue", "state", "GPUs", "submitted", "wait s", "nodes", "reason"):
        table.add_column(col)
    for r in rows:
        gpus = sum(p["count"] * p["gpus_per_pod"] for p in r["spec"]["pod_sets"])
        wait = wait_seconds(r, now)
        table.add_row(r["job_id"], r["team"], r["queue"], f"[{STATE_STYLE.get(r['state'], '')}]{r['state']}[/]",
                      str(gpus), fmt_time(r["submitted_at"]), f"{wait:.0f}" if wait is not None else "-",
                      ",".join(r["nodes"][:3]) + ("…" if len(r["nodes"]) > 3 else ""),
                      r.get("reason") or r.get("sched_reason") or r.get("outcome") or "")
    console.print(table)


def _public(row: dict[str, Any]) -> dict[str, Any]:
    keep = ("job_id", "team", "queue", "state", "reason", "message", "position_in_queue", "position_in_cohort",
            "eta", "submitted_at", "admitted_at", "placed_at", "finished_at", "outcome", "nodes", "sched_reason",
            "sched_message", "planned_start")
    return {k: row.get(k) for k in keep}


def explain(job_id: str = typer.Argument(..., help="The job to explain")) -> None:
    """Why a job waits, where it stands, and when it is expected to start (or what happened to it)."""
    url = database_url()
    rows = asyncio.run(fetch_status(url, job_id))
    if not rows:
        console.print(f"[red]no job {job_id!r}[/]")
        raise typer.Exit(1)
    for line in explain_lines(rows[0], time.time()):
        console.print(line)
    if rows[0]["state"] in ("running", "placed"):
        for line in asyncio.run(_preemption_lines(url, job_id)):
            console.print(f"  {line}")


async def _preemption_lines(url: str, job_id: str) -> list[str]:
    """Whether a running job may be preempted, and by what (from the preemption service's tables)."""
    from services.preemption.visibility import preemption_status

    conn = await asyncpg.connect(url)
    try:
        return await preemption_status(conn, job_id)
    except asyncpg.UndefinedTableError:
        return ["preemption: the preemption service has not run here"]
    finally:
        await conn.close()


def queues(output: str = typer.Option("table", "--format", help="table or json")) -> None:
    """Per queue: nominal, used, borrowed, lent, pending, running, oldest wait."""
    from services.admission.app import load_state
    from services.admission.core import queue_summaries

    async def load() -> list[Any]:
        conn = await asyncpg.connect(database_url())
        try:
            state = await load_state(conn)
        finally:
            await conn.close()
        return queue_summaries(state, time.time())

    try:
        summaries = asyncio.run(load())
    except (LookupError, asyncpg.UndefinedTableError):
        console.print("[red]admission has no state yet: start the platform with `gpuq up`[/]")
        raise typer.Exit(1) from None
    if output == "json":
        typer.echo(json.dumps([dataclasses.asdict(s) for s in summaries], indent=2, default=str))
        return
    table = Table(title="queues")
    for col in ("queue", "cohort", "weight", "nominal", "used", "borrowed", "lent", "pending", "running",
                "oldest wait"):
        table.add_column(col)

    def fmt(d: dict[str, int]) -> str:
        return " ".join(f"{k}:{v}" for k, v in sorted(d.items()) if v) or "0"

    for s in summaries:
        table.add_row(s.queue, s.cohort or "-", f"{s.weight:g}", fmt(s.nominal), fmt(s.used), fmt(s.borrowed),
                      fmt(s.lent), str(s.pending), str(s.running),
                      f"{s.oldest_wait_s:.0f} s" if s.oldest_wait_s is not None else "-")
    console.print(table)


def cancel(job_id: str = typer.Argument(..., help="The job to cancel"),
           reason: str = typer.Option("", help="Why")) -> None:
    """Cancel a job (publishes JobCancelled)."""

    async def go() -> None:
        nc = await nats.connect(nats_url(), connect_timeout=5)
        try:
            now = datetime.now(UTC)
            with command_span(f"gpuq cancel {job_id}"):
                await publish_event(nc.jetstream(), traced_event(
                    JobCancelled(job_id=job_id, by="gpuq-cli", reason=reason, cancelled_at=now),
                    source="gpuq-cli", time=now), JobCancelled.subject())
        finally:
            await nc.close()

    asyncio.run(go())
    console.print(f"cancel requested for {job_id}")


def apply_queues(file: Path = typer.Argument(..., help="The new queues.yaml"),
                 by: str = typer.Option("admin", help="Who is changing it (audited)")) -> None:
    """Change teams, quotas and policy at runtime (publishes QueueConfigChanged). Validated here first; admission
    validates again and keeps the old configuration if it refuses the new one. No pending or admitted job is lost."""
    from shared.config import ConfigError, load_queues
    from shared.events import QueueConfigChanged

    try:
        config = load_queues(file)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    for warning in config.warnings():
        console.print(f"[yellow]warning:[/] {warning}")

    async def go() -> None:
        nc = await nats.connect(nats_url(), connect_timeout=5)
        try:
            now = datetime.now(UTC)
            with command_span("gpuq apply-queues"):
                await publish_event(nc.jetstream(), traced_event(
                    QueueConfigChanged(config=config.model_dump(mode="json"), changed_by=by), source="gpuq-cli",
                    time=now), QueueConfigChanged.subject())
        finally:
            await nc.close()

    asyncio.run(go())
    console.print(f"published the configuration of {len(config.queues)} queue(s) from {file}")
