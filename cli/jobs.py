"""Users' commands: submit, status, explain, queues, cancel."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli.api_client import api
from cli.output import (
    Column,
    OutputFormat,
    duration,
    eta_cell,
    eta_range_cell,
    output_option,
    print_machine,
    render_table,
    stdout_console,
    when,
)
from cli.runtime import database_url, nats_url

if TYPE_CHECKING:
    from services.core.admission import QueueSummary
    from shared.domain import JobSpec, NodeSpec
    from shared.events import Payload

# The services' modules (asyncpg, NATS, pydantic models, the admission core) are imported in the functions that use
# them: `gpuq COMMAND --help`, and the commands through the API, start without them (docs/cli.md, start-up time).

console = stdout_console()
VERDICT_WAIT_S = 5.0  # how long `submit` waits for admission's verdict by default, as POST /v1/jobs does


def _specs_from_file(path: Path) -> list[JobSpec]:
    import yaml
    from pydantic import ValidationError

    from services.core.admission.governance import size_violation
    from shared.domain import JobSpec

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"{path}: {exc}", param_hint="FILE") from None
    if isinstance(doc, dict) and "jobs" in doc:
        if not isinstance(doc["jobs"], list):
            raise typer.BadParameter(f"{path}: `jobs:` must be a list of job specs, got "
                                     f"{type(doc['jobs']).__name__}", param_hint="FILE")
        items: list[Any] = doc["jobs"]
    else:
        items = doc if isinstance(doc, list) else [doc]
    specs = []
    for i, item in enumerate(items):
        try:
            specs.append(JobSpec.model_validate(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise typer.BadParameter(f"{path}: job {i}: {where}: {first['msg']}", param_hint="FILE") from None
        # a job asking for no GPU is judged by the server, against its queue's CPU and memory quotas
        violation = size_violation(specs[-1], cpu_queue=True)
        if violation is not None:
            raise typer.BadParameter(f"{path}: job {i}: {violation.reason}: {violation.message}", param_hint="FILE")
    return specs


async def _publish(events: list[tuple[Payload, str]]) -> list[str]:
    """Publish events directly (admin mode: NATS_URL carries a credential allowed to publish them); their ids."""
    from shared.bus import connect
    from shared.service import publish_event
    from shared.tracing import command_span, traced_event

    ids = []
    nc = await connect(nats_url(), "gpuq-cli")
    try:
        js = nc.jetstream()
        now = datetime.now(UTC)
        for payload, subject in events:
            job = payload.job_key()
            # each command's event starts (or continues, from $TRACEPARENT) a trace of its own
            with command_span(f"gpuq {type(payload).__name__} {job}" if job else f"gpuq {type(payload).__name__}"):
                event = traced_event(payload, source="gpuq-cli", time=now)
                await publish_event(js, event, subject)
                ids.append(event.id)
    finally:
        await nc.close()
    return ids


def submit(
    file: Path | None = typer.Argument(None, help="A job spec (YAML/JSON), a list of them, or {jobs: [...]}"),
    team: str | None = typer.Option(None, help="Team submitting the job (with no FILE; through the API, default: "
                                               "the token's team)"),
    queue: str | None = typer.Option(None, help="Queue to submit to (default: the team's name; through the API "
                                                "without --team, the token's team's default queue)"),
    gpus: float = typer.Option(1, help="GPUs per pod: a whole number, at least 1, or a part of one GPU (0.25) that "
                                       "the pod shares with others (time-slicing or MPS nodes)"),
    pods: int = typer.Option(1, help="Pods in the gang"),
    gpu_model: list[str] = typer.Option([], "--gpu-model", help="Acceptable GPU model (repeat for any-of)"),
    priority: str = typer.Option("normal", help="Priority class"),
    max_runtime: int = typer.Option(3600, help="The job's runtime limit / estimate in seconds"),
    rack: bool = typer.Option(False, help="Require the whole gang inside one rack"),
    name: str | None = typer.Option(None, help="Job id (default: generated)"),
    label: list[str] = typer.Option([], help="key=value label for cost attribution (repeatable)"),
    wait: float = typer.Option(VERDICT_WAIT_S, "--wait", min=0, max=30,
                               help="Seconds to wait for admission's verdict (queued, or rejected and why: exit 1)"),
) -> None:
    """Submit jobs by publishing JobSubmitted events (what ML pipelines do too). Waits for admission's verdict on
    each: a rejected job is named with the reason, and the command exits 1."""
    client = api()
    # Through the API a team's token names its team, and the API picks the team's default queue and a job id
    # (`<team>::<random>`): what the command was not told is left out of the body for the API to fill in.
    implied = [key for key, given in (("team", team), ("queue", queue if team is None else team),
                                      ("job_id", name)) if given is None]
    if file is not None:
        specs = _specs_from_file(file)
        implied = []
    else:
        if team is None and client is None:
            raise typer.BadParameter("give a FILE or at least --team (through the API, with GPUQ_API_URL and "
                                     "GPUQ_TOKEN, a team's token implies its team)", param_hint="--team")
        specs = [_spec_from_flags(team=team, queue=queue, gpus=gpus, pods=pods, gpu_model=gpu_model,
                                  priority=priority, max_runtime=max_runtime, rack=rack, name=name, label=label)]
    refused = (_submit_through_api(client, specs, implied, wait) if client is not None
               else _submit_as_admin(specs, wait))
    if refused:
        raise typer.Exit(1)


def _spec_from_flags(*, team: str | None, queue: str | None, gpus: float, pods: int, gpu_model: list[str],
                     priority: str, max_runtime: int, rack: bool, name: str | None, label: list[str]) -> JobSpec:
    """`gpuq submit`'s one job described by its options (no FILE), validated here before anything is sent."""
    from pydantic import ValidationError

    from cli.errors import validation_message
    from shared.domain import JobSpec, PodSet, TopologyLevel, TopologyRequest

    fraction = math.isfinite(gpus) and 0 < gpus < 1
    if not fraction and (not math.isfinite(gpus) or gpus != int(gpus) or gpus < 1):
        # refused here, before anything is published (admission refuses a job without GPUs too)
        raise typer.BadParameter(
            f"{gpus:g} GPUs per pod: give a whole number of GPUs, at least 1, or a part of one GPU between 0 and 1 "
            "(e.g. 0.25: the pod shares a GPU; gpuq schedules GPU jobs; for a MIG slice, submit a job file whose "
            "pod set names a mig_profile)",
            param_hint="--gpus")
    if pods < 1:
        raise typer.BadParameter(f"{pods} pods: a job has at least 1 pod", param_hint="--pods")
    labels = dict(item.split("=", 1) for item in label if "=" in item)
    try:
        return JobSpec(
            # (a stand-in team where the API fills it in: the spec is only validated here, not sent with it)
            job_id=name or f"{team or 'team'}-{uuid.uuid4().hex[:8]}", team=team or "team",
            queue=queue or team or "team",
            priority_class=priority, max_runtime_s=max_runtime, labels=labels,
            pod_sets=(PodSet(count=pods, gpus_per_pod=1 if fraction else int(gpus),
                             gpu_fraction=gpus if fraction else None, gpu_models=tuple(gpu_model)),),
            topology=TopologyRequest(required_level=TopologyLevel.RACK) if rack else TopologyRequest())
    except ValidationError as exc:
        raise typer.BadParameter(validation_message(exc)) from None


def _submit_through_api(client: Any, specs: list[JobSpec], implied: list[str], wait: float) -> int:
    """POST the jobs to the API (which waits up to `wait` s for the verdicts), print each; how many were refused."""
    body = [{k: v for k, v in s.model_dump(mode="json").items() if k not in implied} for s in specs]
    results = client.call("POST", "/v1/jobs", json={"jobs": body}, params={"wait": wait})
    refused = 0
    for r in results:
        if r["verdict"] == "rejected":
            refused += 1
            console.print(f"[red]refused[/] {r['job_id']}: {r['reason']}: {r['message']}")
        else:
            console.print(f"submitted [bold]{r['job_id']}[/]: {r['verdict']}"
                          + (f" ({r['reason']}: {r['message']})" if r.get("reason") else ""))
    return refused


def _submit_as_admin(specs: list[JobSpec], wait: float) -> int:
    """Publish JobSubmitted events on the bus (admin mode), wait up to `wait` s for admission's verdicts in its
    table, print each; how many were refused."""
    from shared.events import JobSubmitted

    now = datetime.now(UTC)
    event_ids = asyncio.run(_publish([(JobSubmitted(spec=spec, submitted_at=now, submitted_by="gpuq-cli"),
                                       JobSubmitted.scoped_subject(spec.team)) for spec in specs]))
    verdicts = asyncio.run(_admin_verdicts(event_ids, wait)) if wait > 0 else {}
    refused = 0
    for spec, event_id in zip(specs, event_ids, strict=True):
        what = f"[bold]{spec.job_id}[/] to queue {spec.queue} ({spec.total_gpus} GPU)"
        verdict = verdicts.get(event_id)
        if verdict is None:
            console.print(f"submitted {what}" + (f": no verdict from admission within {wait:g} s (is it running? "
                                                  f"`gpuq status {spec.job_id}` shows it later)" if wait > 0 else ""))
        elif verdict["verdict"] == "rejected":
            refused += 1
            console.print(f"[red]refused[/] {spec.job_id}: {verdict['reason']}: {verdict['message']}")
        else:
            console.print(f"submitted {what}: {verdict['verdict']}"
                          + (f" ({verdict['reason']}: {verdict['message']})" if verdict["reason"] else ""))
    return refused


async def _admin_verdicts(event_ids: list[str], wait_s: float) -> dict[str, dict[str, Any]]:
    """Admission's verdict on each submission event (admission.submissions, keyed by the event's id), waiting up to
    `wait_s` for all of them; {} without a database to read them from (NATS_URL only)."""
    import asyncpg

    try:
        url = database_url()
    except typer.BadParameter:
        return {}
    found: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + wait_s
    conn = await asyncpg.connect(url)
    try:
        while True:
            if await conn.fetchval("SELECT to_regclass('admission.submissions') IS NOT NULL"):
                for r in await conn.fetch("SELECT event_id, verdict, reason, message FROM admission.submissions "
                                          "WHERE event_id = ANY($1::text[])", event_ids):
                    found[r["event_id"]] = dict(r)
            if len(found) == len(event_ids) or time.monotonic() >= deadline:
                return found
            await asyncio.sleep(0.1)
    finally:
        await conn.close()


STATE_STYLE = {"completed": "green", "running": "cyan", "placed": "cyan", "pending": "yellow", "admitted": "yellow",
               "rejected": "red", "failed": "red", "cancelled": "magenta"}


def status(
    job_id: str | None = typer.Argument(None, help="One job's id"),
    all_jobs: bool = typer.Option(False, "--all", help="Every job, not only active ones"),
    output: OutputFormat = output_option("--format"),
    limit: int = typer.Option(200, help="At most this many rows"),
) -> None:
    """Where jobs are: pending, admitted, running, completed, failed, rejected (your team's, through the API)."""
    client = api()
    if client is not None:
        rows = ([client.call("GET", f"/v1/jobs/{job_id}")] if job_id else
                client.call("GET", "/v1/jobs", params={"all": all_jobs, "limit": limit}))
    else:
        from services.api.readmodel import fetch_status, public

        rows = [public(r) for r in asyncio.run(fetch_status(database_url(), job_id,
                                                             limit=None if job_id else limit * 50))]
    if job_id and not rows:
        console.print(f"[red]no job {job_id!r}[/]")
        raise typer.Exit(1)
    if not job_id and not all_jobs:
        rows = [r for r in rows if r["state"] in ("pending", "admitted", "placed", "running")]
    rows = rows[-limit:]
    if output.machine:
        print_machine(rows, output)
        return
    print_status_table(rows, output, time.time())


# `gpuq status`'s columns: at an 80-column terminal the ids, state, GPUs and reason stay; the others go, the
# highest `drop` first (cli/output.py); `-o wide` adds the expected start's range and the message.
STATUS_COLUMNS = (Column("job"), Column("team", drop=4), Column("queue"), Column("state"),
                  Column("GPUs", justify="right"), Column("submitted", drop=6), Column("wait", justify="right", drop=2),
                  Column("expected start", drop=3), Column("likely between", wide=True),
                  Column("nodes", kind="words", drop=5), Column("reason", kind="words", drop=1),
                  Column("message", kind="text", wide=True))


def job_wait(row: dict[str, Any], now: float) -> float | None:
    """How long a job has waited to start: until now while it is pending or admitted but not placed (it still
    waits), until its placement once placed, until its end if it ended without one; None for a rejected job."""
    if row["state"] == "rejected" or row.get("submitted_at") is None:
        return None
    if row["state"] in ("pending", "admitted"):
        return max(0.0, now - row["submitted_at"])
    end = row.get("placed_at") or row.get("finished_at")
    return None if end is None else max(0.0, end - row["submitted_at"])


def print_status_table(rows: list[dict[str, Any]], output: OutputFormat, now: float) -> None:
    from rich.text import Text

    cells = []
    for r in rows:
        waiting = r["state"] in ("pending", "admitted")
        cells.append([r["job_id"], r["team"], r["queue"], Text(r["state"], style=STATE_STYLE.get(r["state"], "")),
                      "-" if r.get("gpus") is None else str(r["gpus"]), when(r.get("submitted_at")),
                      # the API's wait and ETA verdict when it gives them (on the platform's clock), else from here
                      duration(r["wait_s"] if "wait_s" in r else job_wait(r, now)),
                      eta_cell(r.get("eta"), now, r.get("eta_overdue")) if waiting else "-",
                      eta_range_cell(r.get("eta_low"), r.get("eta_high"), now) if waiting else "-",
                      ", ".join(r.get("nodes") or []) or "-",
                      r.get("reason") or r.get("sched_reason") or r.get("outcome") or "",
                      r.get("message") or r.get("sched_message") or ""])
    render_table(STATUS_COLUMNS, cells, fmt=output, console=console, title=f"{len(rows)} job(s)")


def explain(job_id: str = typer.Argument(..., help="The job to explain")) -> None:
    """Why a job waits, where it stands, and when it is expected to start (or what happened to it)."""
    client = api()
    if client is not None:
        for line in client.call("GET", f"/v1/jobs/{job_id}/explain")["lines"]:
            console.print(line)
        return
    from services.api.readmodel import explain_lines, fetch_status

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
    """Whether a running job may be preempted, and by what (services/preemption/visibility.py: the scheduler's read
    model, and the preemption service's protocol tables)."""
    import asyncpg

    from services.preemption.visibility import preemption_status

    conn = await asyncpg.connect(url)
    try:
        return await preemption_status(conn, job_id)
    except asyncpg.UndefinedTableError:
        return ["preemption: the preemption service has not run here"]
    finally:
        await conn.close()


def queues(output: OutputFormat = output_option("--format")) -> None:
    """Per queue: nominal, used, borrowed, lent, pending, running, oldest wait; the configuration version in force;
    and the GPUs pods gpuq does not manage hold on its nodes (read from the platform's database)."""
    import asyncpg

    from services.core.admission import QueueSummary

    client = api()
    if client is not None:
        _print_queues([QueueSummary(**q) for q in client.call("GET", "/v1/queues")], output)
        if not output.machine:
            console.print(version_line(client.call("GET", "/v1/queues/config")))
            line = client.call("GET", "/v1/queues/held").get("line")
            if line:
                console.print(line)
        return
    from services.admission import configmodel, queuemodel
    from services.scheduler import readmodel

    async def load() -> tuple[list[Any], list[NodeSpec], dict[str, Any] | None]:
        conn = await asyncpg.connect(database_url())
        try:
            facts = await queuemodel.queues(conn)  # admission's read model, as the API reads it
            nodes = await readmodel.nodes(conn)
            current = await configmodel.in_force(conn)
        finally:
            await conn.close()
        if facts is None:
            raise LookupError("admission has written no queue rows yet")
        now = time.time()
        return [f.at(now) for f in facts], nodes, _version_body(current)

    try:
        summaries, nodes, version = asyncio.run(load())
    except (LookupError, asyncpg.UndefinedTableError):
        console.print("[red]admission has no state yet: start the platform with `gpuq up`[/]")
        raise typer.Exit(1) from None
    _print_queues(summaries, output)
    if not output.machine:
        if version is not None:
            console.print(version_line(version))
        for line in held_lines(nodes):
            console.print(line)


def _version_body(current: Any) -> dict[str, Any] | None:
    """A configmodel.ConfigVersion as GET /v1/queues/config answers it."""
    return None if current is None else {"version": current.version, "hash": current.hash,
                                         "applied_at": current.applied_at, "applied_by": current.applied_by,
                                         "source": current.source}


def version_line(version: dict[str, Any]) -> str:
    """The queue configuration in force, as GET /v1/queues/config gives it."""
    source = {"file": "queues.yaml at start", "change": "a change"}.get(version.get("source") or "", "")
    return (f"configuration: version {version['version']} ({str(version['hash'])[:12]}), applied "
            f"{when(float(version['applied_at']))} by "
            f"{version['applied_by']}" + (f" from {source}" if source else ""))


def held_lines(nodes: list[NodeSpec]) -> list[str]:
    """What pods gpuq does not manage hold on its nodes (another scheduler's, a DaemonSet's, an inference
    Deployment's): GPUs gpuq does not place onto, which no queue's quota can use. Nothing when they hold none. The
    words are the scheduler read model's, which GET /v1/queues/held answers too."""
    from services.scheduler.readmodel import held_outside

    line = held_outside(nodes)["line"]
    return [str(line)] if line else []


# `gpuq queues`' columns: per GPU model `MODEL:N` entries, which wrap between entries at a narrow terminal.
QUEUE_COLUMNS = (Column("queue"), Column("cohort", drop=3), Column("weight", justify="right", drop=5),
                 Column("nominal", kind="words"), Column("used", kind="words"),
                 Column("borrowed", kind="words", drop=2), Column("lent", kind="words", drop=4),
                 Column("pending", justify="right"),
                 Column("running", justify="right"), Column("oldest wait", justify="right", drop=1))


def _print_queues(summaries: list[QueueSummary], output: OutputFormat) -> None:
    records = [dataclasses.asdict(s) for s in summaries]
    if output.machine:
        print_machine(records, output)
        return

    from shared.quota_keys import shown

    def fmt(d: dict[str, int]) -> str:  # CPU in cores, memory in Gi/Mi (cpu_milli, memory_mib in machine formats)
        return " ".join(shown(k, v) for k, v in sorted(d.items()) if v) or "0"

    rows = [[s.queue, s.cohort or "-", f"{s.weight:g}", fmt(s.nominal), fmt(s.used), fmt(s.borrowed), fmt(s.lent),
             str(s.pending), str(s.running), duration(s.oldest_wait_s)] for s in summaries]
    render_table(QUEUE_COLUMNS, rows, fmt=output, console=console, title="queues")


def cancel(job_id: str = typer.Argument(..., help="The job to cancel"),
           reason: str = typer.Option("", help="Why"),
           before_arrival: bool = typer.Option(
               False, "--before-arrival", help="Through the API: cancel a job you submitted that gpuq does not know "
                                               "yet (cancelled the moment it arrives); otherwise an unknown job is "
                                               "refused")) -> None:
    """Cancel a job of your team (any job: admins). Admission checks the team and cancels it, also when the job has
    not reached it yet (it is then cancelled the moment it arrives)."""
    from cli.api_client import ApiError

    client = api()
    if client is not None:
        if not before_arrival:
            try:
                client.request("GET", f"/v1/jobs/{job_id}")
            except ApiError as exc:
                if exc.status != 404:
                    raise typer.BadParameter(f"{exc.status}: {exc.detail}") from None
                typer.echo(f"error: no job {job_id!r}: nothing to cancel (for a job submitted but not arrived yet, "
                           "add --before-arrival)", err=True)
                raise typer.Exit(1) from None
        client.call("POST", f"/v1/jobs/{job_id}/cancel", json={"reason": reason})
        console.print(f"cancel requested for {job_id}")
        return
    from services.api.readmodel import fetch_status
    from shared.events import JobCancelRequested

    rows = asyncio.run(fetch_status(database_url(), job_id))
    if not rows:
        typer.echo(f"error: no job {job_id!r}: nothing to cancel (through the API, a team may cancel a job that "
                   "has not arrived yet: --before-arrival)", err=True)
        raise typer.Exit(1)
    now = datetime.now(UTC)
    asyncio.run(_publish([(JobCancelRequested(job_id=job_id, requested_by="gpuq-cli (admin)", reason=reason,
                                              requested_at=now), JobCancelRequested.scoped_subject(rows[0]["team"]))]))
    console.print(f"cancel requested for {job_id}")


def approve(job_id: str = typer.Argument(..., help="A job waiting with reason AwaitingApproval"),
            by: str = typer.Option("admin", help="Who approves (audited; through the API: the token's name)")) -> None:
    """Approve a job of a priority class that needs a platform admin's approval (queues.yaml governance)."""
    client = api()
    if client is not None:
        client.call("POST", f"/v1/jobs/{job_id}/approve")
    else:
        from services.api.readmodel import fetch_status
        from services.core.admission.governance import AWAITING_APPROVAL
        from shared.events import JobApproved

        # as the API refuses it: admission would drop an approval of a job that does not wait for one, unseen
        rows = asyncio.run(fetch_status(database_url(), job_id))
        if not rows:
            typer.echo(f"error: no job {job_id!r}: nothing to approve", err=True)
            raise typer.Exit(1)
        if rows[0].get("reason") != AWAITING_APPROVAL:
            typer.echo(f"error: job {job_id} is not awaiting approval ({rows[0]['state']})", err=True)
            raise typer.Exit(1)
        asyncio.run(_publish([(JobApproved(job_id=job_id, approved_by=by, approved_at=datetime.now(UTC)),
                               JobApproved.subject())]))
    console.print(f"approved {job_id}")


def apply_queues(file: Path = typer.Argument(..., help="The new queues.yaml"),
                 by: str = typer.Option("admin", help="Who is changing it (audited)"),
                 wait: float = typer.Option(30.0, "--wait", help="Seconds to wait until admission has recorded it as "
                                                                 "the version in force (0: do not wait)"),
                 dry_run: bool = typer.Option(False, "--dry-run", help="Print what would change and the warnings "
                                                                       "against the live cluster; apply nothing"),
                 force: bool = typer.Option(False, "--force", help="Apply it although it is refused (a guarantee "
                                                                   "past capacity, an unknown GPU model, a queue "
                                                                   "removed under its jobs); audited")) -> None:
    """Change teams, quotas and policy at runtime (publishes QueueConfigChanged: a proposal). Checked here first
    against the version in force and the live cluster (`--dry-run` prints the diff and stops); admission, the
    configuration's owner, checks again and records it as the next version, which every service then runs on; it
    keeps the old configuration if it refuses the new one. No pending or admitted job is lost."""
    from shared.config import ConfigError, load_queues, queues_document, queues_hash
    from shared.events import QueueConfigChanged

    try:
        config = load_queues(file)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    client = api()
    checked = _check_config(client, queues_document(config))
    for line in checked["diff"] or ["(no queue, cohort or priority class changes)"]:
        console.print(line, markup=False, highlight=False)
    for warning in checked["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    for refusal in checked["refusals"]:
        console.print(f"[red]{'overridden (--force)' if force else 'refused'}:[/] {refusal}", highlight=False)
    if dry_run:
        console.print("dry run: nothing applied" + (" (it would be refused without --force)"
                                                   if checked["refusals"] else ""))
        raise typer.Exit(1 if checked["refusals"] and not force else 0)
    if checked["refusals"] and not force:
        console.print(f"[red]not applied[/]: {file} would be refused by admission; fix it, or apply it with --force "
                      "(audited)")
        raise typer.Exit(1)

    content = queues_hash(config)
    if client is not None:
        client.call("PUT", "/v1/queues/config", json={"config": queues_document(config), "force": force})
    else:
        asyncio.run(_publish([(QueueConfigChanged(config=queues_document(config), changed_by=by,
                                                  force=True if force else None),
                               QueueConfigChanged.subject())]))
    console.print(f"published the configuration of {len(config.queues)} queue(s) from {file} ({content[:12]})"
                  + (" with --force" if force else ""))
    if wait <= 0:
        return
    version = asyncio.run(_in_force_with(content, wait))
    if version is None:
        console.print(f"[red]not in force after {wait:g} s[/]: admission has not recorded it (is it running? a "
                      "refusal is in `gpuq audit`, action config_refused)")
        raise typer.Exit(1)
    console.print(version_line(version))


def _check_config(client: Any, document: dict[str, Any]) -> dict[str, list[str]]:
    """The diff, warnings and refusals of a proposed configuration against the version in force and the live
    cluster: the API's check (POST /v1/queues/config/check), or in admin mode the same check on the database."""
    if client is not None:
        body: dict[str, list[str]] = client.call("POST", "/v1/queues/config/check", json={"config": document})
        return body
    import asyncpg

    from services.admission.changecheck import check_proposal
    from shared.config import parse_queues

    async def check() -> dict[str, list[str]]:
        conn = await asyncpg.connect(database_url())
        try:
            result = await check_proposal(conn, parse_queues(document, "queues.yaml"))
        finally:
            await conn.close()
        return {"diff": list(result.diff), "warnings": list(result.warnings), "refusals": list(result.refusals)}

    return asyncio.run(check())


async def _in_force_with(content: str, wait_s: float) -> dict[str, Any] | None:
    """The version in force once its content has this hash (None: not within `wait_s`)."""
    import asyncpg

    from services.admission import configmodel

    client = api()
    deadline = time.monotonic() + wait_s
    while True:
        if client is not None:
            version: dict[str, Any] | None = await asyncio.to_thread(client.call, "GET", "/v1/queues/config")
        else:
            conn = await asyncpg.connect(database_url())
            try:
                current = await configmodel.in_force(conn)
            finally:
                await conn.close()
            version = _version_body(current)
        if version is not None and version["hash"] == content:
            return version
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.5)
