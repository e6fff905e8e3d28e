"""`gpuq bench admission-e2e`: admissions per second of the admission *service*, database included.

Each JobSubmitted goes through the real runtime's `handle()` as the consumer would hand it over: envelope
parsing, the inbox row, the handler (the job's row, then a full admission cycle), the status rows, the
JobAdmitted/JobPending events written to the outbox, and the commit — one event per transaction, as in
production. NATS is not involved (the outbox relay publishes afterwards, off this path). Runs against a scratch
database created and dropped on the Postgres in DATABASE_URL, or on an embedded Postgres when none is set.

Two figures: `--jobs` submissions that all fit their quota (each is admitted by the cycle its own event runs),
first into an empty platform, then again with `--backlog` jobs waiting in a queue without quota left: in a
queue of its own (the cycle reuses that unchanged scope and the service skips it) or, with `--same-cohort`, in
the cohort the submissions go to (every cycle re-judges them and the service re-reads their statuses).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress

BENCH_DB = "gpuq_bench_admission"


def _queues(queues: int, jobs: int, same_cohort: bool) -> dict[str, Any]:
    per_queue = jobs // queues + 1
    return {
        "priority_classes": [{"name": "normal", "value": 100}],
        "cohorts": [{"name": "bench"}],
        "queues": [{"name": f"team-{i:02d}", "cohort": "bench", "quotas": {"H100-80GB": {"nominal": per_queue}}}
                   for i in range(queues)]
        # room for one job and no borrowing: the first backlog job holds it, the others wait behind it; in
        # its own scope (no cohort) unless --same-cohort puts it in the busy cohort, judged on every cycle
        + [{"name": "waiting", **({"cohort": "bench"} if same_cohort else {}),
            "quotas": {"H100-80GB": {"nominal": 1, "borrowing_limit": 0}}}],
    }


def _submitted(job_id: str, queue: str, at: datetime) -> bytes:
    from shared.domain import JobSpec, PodSet
    from shared.events import JobSubmitted, encode_event, make_event

    spec = JobSpec(job_id=job_id, team=queue, queue=queue,
                   pod_sets=(PodSet(count=1, gpus_per_pod=1, gpu_models=("H100-80GB",)),))
    return encode_event(make_event(JobSubmitted(spec=spec, submitted_at=at), source="bench", time=at))


async def _run(base_url: str, queues: int, jobs: int, backlog: int, same_cohort: bool,
               progress: Progress) -> dict[str, Any]:
    from services.admission.app import AdmissionService
    from shared.clock import ManualClock
    from shared.config import parse_queues
    from shared.db import apply_migrations, create_pool, drop_database, scratch_database
    from shared.service import PLUMBING_SQL, ServiceRuntime

    url, bench_db = await scratch_database(base_url, BENCH_DB)
    pool = await create_pool(url, min_size=1, max_size=4)
    t0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
    out: dict[str, Any] = {"queues": queues, "jobs": jobs, "backlog": backlog, "same_cohort": same_cohort}
    try:
        config = parse_queues(_queues(queues, 2 * jobs, same_cohort))
        runtime = ServiceRuntime(AdmissionService(config).spec(), nats_url="nats://127.0.0.1:1", pool=pool,
                                 clock=ManualClock(), database_url=url)
        # the runtime's prepare() minus the broker: plumbing tables and migrations (NATS is not on this path)
        async with pool.acquire() as conn:
            await conn.execute(PLUMBING_SQL.format(s=runtime.spec.schema))
        assert runtime.spec.migrations is not None and runtime.spec.on_start is not None
        await apply_migrations(pool, runtime.spec.schema, runtime.spec.migrations)
        await runtime.spec.on_start(runtime)

        async def submit(label: str, raws: list[bytes]) -> list[float]:
            task = progress.add_task(label, total=len(raws))
            times = []
            for raw in raws:
                start = time.perf_counter()
                outcome = await runtime.handle(raw)
                times.append(time.perf_counter() - start)
                assert outcome == "handled", outcome
                progress.advance(task)
            return times

        def fitting(offset: int) -> list[bytes]:
            return [_submitted(f"fit-{offset + n}", f"team-{n % queues:02d}", t0 + timedelta(seconds=offset + n))
                    for n in range(jobs)]

        empty = await submit("into an empty platform", fitting(0))
        await submit(f"backlog of {backlog} waiting jobs (untimed)",
                     [_submitted(f"wait-{n}", "waiting", t0 + timedelta(seconds=n)) for n in range(backlog)])
        deep = await submit(f"with {backlog} waiting", fitting(jobs))
        async with pool.acquire() as conn:
            admitted = await conn.fetchval("SELECT count(*) FROM admission.jobs WHERE status = 'admitted'")
            waiting = await conn.fetchval("SELECT count(*) FROM admission.jobs WHERE status = 'pending' "
                                          "AND reason IS NOT NULL")
            events = json.loads(await conn.fetchval(
                "SELECT json_object_agg(t, n) FROM (SELECT split_part(subject, '.', 3) AS t, count(*) AS n "
                "FROM admission.outbox GROUP BY 1) x"))
        want = 2 * jobs + min(1, backlog)  # the fitting jobs, and the backlog's first job
        assert admitted == want, f"expected {want} admitted, found {admitted}"
        assert waiting == max(0, backlog - 1), f"expected {backlog - 1} waiting jobs with a reason, found {waiting}"
        for name, times in (("empty", empty), ("with_backlog", deep)):
            ordered = sorted(times)
            out[f"{name}_admissions_per_s"] = round(len(times) / sum(times), 1)
            out[f"{name}_p50_ms"] = round(statistics.median(times) * 1000, 2)
            out[f"{name}_p99_ms"] = round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 2)
        out["outbox_events"] = events
    finally:
        await pool.close()
        await drop_database(base_url, bench_db)
    return out


def bench_admission_e2e(
    jobs: int = typer.Option(2000, help="Submissions that fit their quota, timed (twice: empty, then with backlog)."),
    queues: int = typer.Option(10, help="Team queues (one cohort) sharing the submissions round-robin."),
    backlog: int = typer.Option(2000, help="Jobs left waiting (no quota) before the second timed run."),
    same_cohort: bool = typer.Option(False, "--same-cohort", help="Put the waiting jobs' queue in the cohort "
                                     "the submissions go to, so every cycle re-judges them (the hard case)."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as one JSON object."),
) -> None:
    """Admissions per second of the admission service with its database: one JobSubmitted per transaction
    through the runtime (inbox, handler, full cycle, status rows, outbox), as in production."""
    from shared.servers import resolve_servers

    data_dir = Path(tempfile.mkdtemp(prefix="gpuq-bench-admission-"))
    servers = resolve_servers(data_dir)
    try:
        with Progress(transient=True, disable=as_json, console=Console(file=sys.stderr)) as progress:
            result = asyncio.run(_run(servers.database_url, queues, jobs, backlog, same_cohort, progress))
    finally:
        servers.close()
    result["postgres"] = servers.origin.get("postgres", "")
    if as_json:
        typer.echo(json.dumps(result))
        return
    console = Console()
    for k, v in result.items():
        console.print(f"{k:>30}: {v}")
