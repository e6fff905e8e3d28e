"""`gpuq bench metering`: how many GPU samples per second the ledger absorbs.

Two paths are measured against a scratch database (created and dropped on the Postgres in DATABASE_URL, or
on an embedded Postgres when none is set):
- runtime: one UtilizationSampled event (one node, all its GPUs) per transaction through the real service
  runtime's `handle()` — envelope parsing, inbox row, the ledger insert, commit — as in production;
- batched: a pulled batch of events per transaction (`batch.handle_sample_batch`: parse, inbox rows and
  one samples statement), for a consumer that hands over whole pulls.
Then every event is delivered again under a new id (what an inbox cannot catch) and the ledger is checked
to have counted each sample once.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress

BENCH_DB = "gpuq_bench_metering"


def _events(nodes: int, gpus: int, intervals: int, interval_s: float, t0: datetime, offset: int) -> list[Any]:
    from shared.events import GpuSample, UtilizationSampled

    out = []
    for k in range(intervals):
        at = t0 + timedelta(seconds=(offset + k + 1) * interval_s)
        for n in range(nodes):
            samples = tuple(
                GpuSample(job_id=f"bench-job-{n}", gpu_index=g, utilization_pct=float((n * 7 + g * 13 + k) % 101),
                          memory_used_mib=40_000 + g, power_w=300.0 + (g * 17 + k) % 400, temperature_c=60.0)
                for g in range(gpus))
            out.append(UtilizationSampled(node=f"bench-{n}", gpu_model="H100-80GB", sampled_at=at,
                                          interval_s=interval_s, samples=samples))
    return out


async def _run(base_url: str, nodes: int, gpus: int, intervals: int, batch: int, interval_s: float,
               replicas: int, keep: bool, progress: Progress) -> dict[str, Any]:

    from services.metering import store
    from services.metering.app import SPEC
    from services.metering.batch import handle_sample_batch
    from shared.db import create_pool, drop_database, scratch_database
    from shared.domain import GpuBinding, JobSpec, PodSet
    from shared.events import JobPlaced, encode_event, make_event
    from shared.service import PLUMBING_SQL, ServiceRuntime

    url, bench_db = await scratch_database(base_url, BENCH_DB)
    pool = await create_pool(url, min_size=1, max_size=max(4, replicas + 1))
    try:
        async with pool.acquire() as conn:
            await conn.execute(PLUMBING_SQL.format(s=store.SCHEMA))
        await store.migrate(pool)
        t0 = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)
        async with pool.acquire() as conn, conn.transaction():
            for n in range(nodes):
                spec = JobSpec(job_id=f"bench-job-{n}", team=f"team-{n % 4}", queue=f"team-{n % 4}",
                               pod_sets=(PodSet(count=1, gpus_per_pod=gpus, gpu_models=("H100-80GB",)),),
                               labels={"feature": f"f{n % 3}"})
                await store.record_placed(conn, JobPlaced(
                    job_id=spec.job_id, spec=spec, placed_at=t0,
                    bindings=(GpuBinding(pod="main-0", node=f"bench-{n}", gpu_indices=tuple(range(gpus))),)))

        # 1. Runtime path: one event per transaction through ServiceRuntime.handle (parse + inbox + ledger),
        #    first with one replica, then with `replicas` sharing the consumer (they split the messages).
        first = _events(nodes, gpus, intervals, interval_s, t0, 0)
        raws = [encode_event(make_event(ev, source="bench", time=ev.sampled_at)) for ev in first]
        half = len(raws) // 2
        runtime_s: dict[int, float] = {}
        for count, chunk in ((1, raws[:half]), (replicas, raws[half:])):
            runtimes = [ServiceRuntime(SPEC, nats_url="nats://127.0.0.1:1", pool=pool, instance=str(i))
                        for i in range(count)]
            task = progress.add_task(f"runtime path, {count} replica(s), 1 event / tx", total=len(chunk))

            async def consume(rt: Any, mine: list[bytes], task: Any = task) -> None:
                for raw in mine:
                    outcome = await rt.handle(raw)
                    assert outcome == "handled", outcome
                    progress.advance(task)

            start = time.perf_counter()
            await asyncio.gather(*(consume(rt, chunk[i::count]) for i, rt in enumerate(runtimes)))
            runtime_s[count] = time.perf_counter() - start

        # 2. Batched path: a pulled batch of `batch` messages per transaction (parse + inbox + samples).
        second = _events(nodes, gpus, intervals, interval_s, t0, intervals)
        second_raws = [encode_event(make_event(ev, source="bench", time=ev.sampled_at)) for ev in second]
        task = progress.add_task(f"batched path ({batch} events / tx)", total=len(second))
        start = time.perf_counter()
        async with pool.acquire() as conn:
            for i in range(0, len(second_raws), batch):
                outcome = await handle_sample_batch(conn, second_raws[i:i + batch])
                assert outcome.handled == len(second_raws[i:i + batch]), outcome
                progress.advance(task, outcome.handled)
        batched_s = time.perf_counter() - start

        # 3. Redelivery under new event ids: nothing may be counted twice.
        task = progress.add_task("redelivery (new ids)", total=len(first) + len(second))
        start = time.perf_counter()
        again = 0
        async with pool.acquire() as conn:
            for i in range(0, len(first) + len(second), batch):
                samples = (first + second)[i:i + batch]
                async with conn.transaction():
                    again += await store.record_samples(conn, samples)
                progress.advance(task, len(samples))
        redelivery_s = time.perf_counter() - start

        async with pool.acquire() as conn:
            stored = await conn.fetchval("SELECT count(*) FROM metering.gpu_samples")
            rolled = await conn.fetchval("SELECT sum(samples)::bigint FROM metering.usage_hourly")
            start = time.perf_counter()
            summary = await store.team_summary(conn)
            summary_s = time.perf_counter() - start
    finally:
        await pool.close()
        if not keep:
            await drop_database(base_url, bench_db)
    per_interval = nodes * gpus
    expected = 2 * intervals * per_interval
    return {
        "nodes": nodes, "gpus_per_node": gpus, "intervals": 2 * intervals, "batch_events": batch,
        "runtime_path": {
            str(count): {"replicas": count, "events": half, "samples": half * gpus, "seconds": round(sec, 3),
                         "events_per_s": round(half / sec, 1), "samples_per_s": round(half * gpus / sec, 1)}
            for count, sec in runtime_s.items()},
        "batched_path": {"events": len(second), "samples": len(second) * gpus, "seconds": round(batched_s, 3),
                         "samples_per_s": round(len(second) * gpus / batched_s, 1)},
        "redelivery": {"samples": expected, "newly_counted": again, "seconds": round(redelivery_s, 3),
                       "samples_per_s": round(expected / redelivery_s, 1)},
        "ledger": {"expected_samples": expected, "stored_samples": stored, "rolled_up_samples": rolled,
                   "exactly_once": stored == expected and rolled == expected and again == 0},
        "team_summary_s": round(summary_s, 4),
        "team_summary": summary,
    }


def bench_metering(
    nodes: int = typer.Option(64, help="Nodes reporting (one UtilizationSampled per node per interval)."),
    gpus_per_node: int = typer.Option(8, help="GPU samples carried by each event."),
    intervals: int = typer.Option(20, help="Sampling intervals per path (runtime path, then batched)."),
    batch: int = typer.Option(32, help="Events per transaction on the batched path (a pulled batch)."),
    replicas: int = typer.Option(4, help="Service replicas sharing the consumer on the second runtime run."),
    interval_s: float = typer.Option(10.0, help="Sampling interval, seconds."),
    keep: bool = typer.Option(False, help=f"Keep the scratch database ({BENCH_DB}_<random>) afterwards."),
    database_url: str | None = typer.Option(None, "--database-url", envvar="DATABASE_URL",
                                            help="Postgres server to use (a scratch database is created on "
                                                 "it); default: an embedded Postgres."),
    json_out: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """Sustained GPU samples/s into the metering ledger (per-event transactions and batched), with an
    exactly-once check after redelivery."""
    console = Console(stderr=True)
    embedded = None
    tmp = None
    try:
        if not database_url:
            from shared.servers import EmbeddedPostgres

            tmp = tempfile.TemporaryDirectory(prefix="gpuq-bench-metering-")
            console.print("no DATABASE_URL: starting an embedded Postgres (pgserver)")
            embedded = EmbeddedPostgres(Path(tmp.name))
            database_url = embedded.start()
        with Progress(console=console, transient=True) as progress:
            result = asyncio.run(_run(database_url, nodes, gpus_per_node, intervals, batch, interval_s,
                                      replicas, keep, progress))
    finally:
        if embedded is not None:
            embedded.stop()
        if tmp is not None:
            tmp.cleanup()
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    out = Console()
    bp, rd = result["batched_path"], result["redelivery"]
    out.print(f"metering ingest, {nodes} nodes × {gpus_per_node} GPUs, {result['intervals']} intervals")
    for rp in result["runtime_path"].values():
        out.print(f"  runtime path, {rp['replicas']} replica(s), 1 event/tx: "
                  f"{rp['samples_per_s']:>9,.0f} GPU samples/s ({rp['events_per_s']:,.0f} events/s)")
    out.print(f"  batched path, {batch} events/tx:          {bp['samples_per_s']:>9,.0f} GPU samples/s")
    out.print(f"  redelivery (all again, new ids):      {rd['samples_per_s']:>9,.0f} samples/s, "
              f"{rd['newly_counted']} counted twice")
    out.print(f"  exactly once: {result['ledger']['exactly_once']}  "
              f"(team summary over the ledger: {result['team_summary_s'] * 1000:.0f} ms)")
