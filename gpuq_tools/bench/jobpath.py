"""`gpuq bench jobpath`: CPU of the scheduler's and the simulated executor's handlers per placed job.

A fixed event sequence goes through each service's real consumer path (`ServiceRuntime` handling a pulled batch
in one transaction: parsing, inbox rows, handlers, the scheduling cycle deferred to the batch's end, the outbox
rows), against a scratch database on the Postgres in DATABASE_URL (created and dropped). NATS is not involved:
batches are handed over as the pull loop would hand them, and the outbox is not relayed. The figure is this
process's CPU (`time.process_time`, asyncpg's client side included, Postgres's own CPU not), so it does not
depend on the wall clock or on what else the machine runs.

Phases (`--nodes` 8-GPU nodes, `--jobs` 1-GPU jobs, `--batch` events per batch):
1. scheduler, admitted: every job admitted; the first nodes×8 are placed as they arrive, the rest wait;
2. scheduler, started: a JobStarted for each placed job (moves its expected end on the running timeline);
3. executor, placed: the JobPlaced events phase 1 wrote to the scheduler's outbox (check, run row, JobStarted);
4. scheduler, finished: `--finish` placed jobs complete, each batch's cycle placing as many waiting ones;
5. executor, ends: one tick in which `--finish` runs end (JobCompleted and the run rows).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import typer
from rich.console import Console

BENCH_DB = "gpuq_bench_jobpath"


@dataclass
class _Meta:
    class _Seq:
        stream = 0

    sequence = _Seq()
    num_delivered = 1


class _Msg:
    """What the runtime's batch path reads of a pulled NATS message."""

    metadata = _Meta()

    def __init__(self, subject: str, data: bytes):
        self.subject, self.data = subject, data

    async def ack(self) -> None:
        return None

    async def nak(self, delay: float | None = None) -> None:
        raise AssertionError(f"a benchmark event failed on {self.subject}")


def _cluster(nodes: int) -> dict[str, Any]:
    return {"node_groups": [{"name": "h100", "count": nodes, "gpus_per_node": 8, "gpu_model": "H100-80GB",
                             "cpu_milli": 192_000, "memory_mib": 2_000_000, "nodes_per_rack": 8}]}


def _queues(queues: int) -> dict[str, Any]:
    return {"priority_classes": [{"name": "normal", "value": 100, "preemptible": True}], "cohorts": [{"name": "b"}],
            "queues": [{"name": f"team-{i:02d}", "cohort": "b", "quotas": {"H100-80GB": {"nominal": 1_000_000}}}
                       for i in range(queues)]}


async def _run(base_url: str, nodes: int, jobs: int, finish: int, batch: int, queues: int) -> dict[str, Any]:
    from services.executor.sim import DURATION_LABEL, SimExecutor, SimExecutorSettings
    from services.scheduler.app import SchedulerService
    from shared.clock import ManualClock
    from shared.config import parse_cluster, parse_queues
    from shared.db import apply_migrations, create_pool, drop_database, scratch_database
    from shared.domain import JobSpec, PodSet
    from shared.events import JobAdmitted, JobCompleted, JobStarted, NodeInventory, encode_event, make_event
    from shared.service import PLUMBING_SQL, ServiceRuntime, default_subject

    url, bench_db = await scratch_database(base_url, BENCH_DB)
    pool = await create_pool(url, min_size=1, max_size=4)
    t0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
    clock = ManualClock(t0.timestamp())
    out: dict[str, Any] = {"nodes": nodes, "jobs": jobs, "finish": finish, "batch": batch}
    cluster = parse_cluster(_cluster(nodes))

    runtimes: list[ServiceRuntime] = []

    async def runtime_of(spec: Any) -> ServiceRuntime:
        runtime = ServiceRuntime(spec, nats_url="nats://127.0.0.1:1", pool=pool, clock=clock, database_url=url)
        runtimes.append(runtime)
        async with pool.acquire() as conn:  # prepare() without the broker: NATS is not on this path
            await conn.execute(PLUMBING_SQL.format(s=runtime.spec.schema))
        assert runtime.spec.migrations is not None
        await apply_migrations(pool, runtime.spec.schema, runtime.spec.migrations)
        for lease in runtime.leases:
            await lease.acquire()
        return runtime

    def event(payload: Any) -> _Msg:
        return _Msg(default_subject(payload), encode_event(make_event(payload, source="bench", time=t0)))

    async def feed(runtime: ServiceRuntime, msgs: list[_Msg]) -> float:
        """Hand `msgs` over in batches; the CPU seconds it took."""
        start = time.process_time()
        for i in range(0, len(msgs), batch):
            # the pull loop's own call (shared/service.py), with stand-ins for the pulled messages
            await runtime._process_batch(cast(Any, msgs[i:i + batch]))
        return time.process_time() - start

    try:
        scheduler = SchedulerService(queues=parse_queues(_queues(queues)))
        srt = await runtime_of(scheduler.spec())
        assert srt.spec.on_start is not None
        await srt.spec.on_start(srt)
        await srt.handle(event(NodeInventory(nodes=tuple(cluster.nodes()))).data)
        specs = [JobSpec(job_id=f"job-{i:06d}", team=f"team-{i % queues:02d}", queue=f"team-{i % queues:02d}",
                         max_runtime_s=86_400, labels={DURATION_LABEL: str(3_600 + i % 600)},
                         pod_sets=(PodSet(count=1, gpus_per_pod=1, gpu_models=("H100-80GB",)),)) for i in range(jobs)]
        admitted = [event(JobAdmitted(job_id=s.job_id, spec=s, flavors={"main": "H100-80GB"},
                                      admitted_at=t0 + timedelta(milliseconds=i))) for i, s in enumerate(specs)]
        cpu = await feed(srt, admitted)
        placed = [r["job_id"] for r in await pool.fetch(
            "SELECT job_id FROM scheduler.jobs WHERE status = 'placed' ORDER BY job_id")]
        out["scheduler_admitted"] = {"events": jobs, "placed": len(placed), "cpu_s": round(cpu, 3),
                                     "cpu_ms_per_placed_job": round(1000 * cpu / max(1, len(placed)), 3)}
        clock.advance(1.0)
        # Starts 10 ms apart, as a burst's are: the expected ends differ (a reservation search releases the first)
        cpu = await feed(srt, [event(JobStarted(job_id=j, nodes=(), started_at=t0 + timedelta(seconds=1 + i / 100)))
                               for i, j in enumerate(placed)])
        out["scheduler_started"] = {"events": len(placed), "cpu_s": round(cpu, 3),
                                    "cpu_ms_per_event": round(1000 * cpu / max(1, len(placed)), 3)}
        # The executor runs the placements phase 1 wrote (the scheduler's outbox, in order), as its consumer would.
        executor = SimExecutor(SimExecutorSettings(cluster=cluster, tick_s=1.0))
        ert = await runtime_of(executor.spec())
        rows = await pool.fetch("SELECT subject, body FROM scheduler.outbox WHERE subject LIKE '%.job.placed' "
                                "ORDER BY seq LIMIT $1", len(placed))
        cpu = await feed(ert, [_Msg(r["subject"], bytes(r["body"])) for r in rows])
        running = await pool.fetchval("SELECT count(*) FROM executor.runs WHERE status = 'running'")
        assert running == len(rows), f"{running} runs for {len(rows)} placements"
        out["executor_placed"] = {"events": len(rows), "cpu_s": round(cpu, 3),
                                  "cpu_ms_per_placed_job": round(1000 * cpu / max(1, len(rows)), 3)}
        clock.advance(1.0)
        done = placed[:finish]
        before = len(placed)
        cpu = await feed(srt, [event(JobCompleted(job_id=j, finished_at=t0 + timedelta(seconds=2))) for j in done])
        now_placed = await pool.fetchval("SELECT count(*) FROM scheduler.jobs WHERE status = 'placed'")
        replaced = now_placed - (before - len(done))
        out["scheduler_finished"] = {"events": len(done), "placed": replaced, "cpu_s": round(cpu, 3),
                                     "cpu_ms_per_placed_job": round(1000 * cpu / max(1, replaced), 3)}

        async with pool.acquire() as conn:  # the first `finish` runs are due
            await conn.execute("UPDATE executor.runs SET ends_at = $1 WHERE job_id IN "
                               "(SELECT job_id FROM executor.runs ORDER BY job_id LIMIT $2)", clock.now(), finish)
        start = time.process_time()
        async with ert.transaction() as tx:
            await executor._finish_due(tx)  # the tick's job ends alone (the samples are measured elsewhere)
        cpu = time.process_time() - start
        ended = await pool.fetchval("SELECT count(*) FROM executor.runs WHERE status <> 'running'")
        out["executor_ends"] = {"ended": ended, "cpu_s": round(cpu, 3),
                                "cpu_ms_per_job": round(1000 * cpu / max(1, ended), 3)}
    finally:
        for runtime in runtimes:
            for lease in reversed(runtime.leases):
                await lease.release()
        await pool.close()
        await drop_database(base_url, bench_db)
    return out


def bench_jobpath(
    nodes: int = typer.Option(1000, help="8-GPU nodes."),
    jobs: int = typer.Option(10_000, help="1-GPU jobs admitted (nodes×8 of them fit)."),
    finish: int = typer.Option(1000, help="placed jobs that complete in phase 3, and runs that end in phase 5."),
    batch: int = typer.Option(32, help="events per pulled batch."),
    queues: int = typer.Option(20, help="queues the jobs are spread over."),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object only"),
) -> None:
    """CPU per placed job of the scheduler's and the simulated executor's handlers over a fixed event sequence."""
    import os

    base = os.environ.get("DATABASE_URL")
    if not base:
        print("DATABASE_URL must name a Postgres server (a scratch database is created on it)", file=sys.stderr)
        raise typer.Exit(2)
    result = asyncio.run(_run(base, nodes, jobs, finish, batch, queues))
    if json_out:
        print(json.dumps(result))
    else:
        Console().print_json(json.dumps(result))


if __name__ == "__main__":  # `python -m gpuq_tools.bench.jobpath` runs the tree it is started in (an A/B's base)
    typer.run(bench_jobpath)
