"""A backup of gpuq's Postgres schemas with `pg_dump`, restored with `pg_restore` into a fresh database on the real
server, serves the platform: the services start on it (their migrations already applied), the jobs, their runs, the
ledger and the audit trail are there, the audit trail is still append-only, and a new job runs through it. After a
restore from a dump taken mid-run, `gpuq reconcile-bus` and a restart on the same bus handle every job exactly once,
those the lost database had handled after the dump included. docs/install.md, "Backups and restore"."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import nats
import pytest

from services.stack import Stack, StackSettings
from shared.bus import stream_for_subject
from shared.clock import ScaledClock
from shared.config import parse_cluster, parse_queues
from shared.domain import JobSpec, PodSet
from shared.events import AuditRecorded, JobSubmitted, make_event
from shared.service import publish_event

# Every schema a gpuq release keeps its state in (docs/install.md, "Uninstall", lists the same).
GPUQ_SCHEMAS = ("admission", "scheduler", "preemption", "metering", "telemetry", "executor", "audit", "api")
SERVICES = ("admission", "scheduler", "preemption", "executor", "metering", "audit")
CLUSTER = parse_cluster({"node_groups": [
    {"name": "a100", "count": 2, "gpus_per_node": 8, "gpu_model": "A100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576, "nodes_per_rack": 2},
]})
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"A100-80GB": {"nominal": 16}}}],
    "gpu_flavors": {"A100-80GB": {"cost_per_gpu_hour": 2.0}},
})
T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
# What a backup must bring back, row for row.
COMPARED = ("SELECT job_id, status FROM admission.jobs ORDER BY job_id",
            "SELECT job_id, status FROM executor.runs ORDER BY job_id",
            "SELECT job_id, kind, at FROM metering.job_facts ORDER BY job_id, kind, at",
            "SELECT id, event_id, recorder, at, action, actor, job_id FROM audit.records ORDER BY id",
            "SELECT version, name, checksum FROM audit.schema_migrations ORDER BY version")


def pg_tool(name: str, server_major: int) -> Path:
    """`name` (pg_dump, pg_restore) of PostgreSQL `server_major` or newer: from PATH, else the client binaries in the
    embedded pgserver wheel (the `embedded` extra, which `make install` installs); the test fails saying exactly
    what is missing otherwise."""
    candidates: list[Path] = []
    on_path = shutil.which(name)
    if on_path:
        candidates.append(Path(on_path))
    try:
        import pgserver
    except ImportError:
        wheel = "the pgserver wheel is not installed"
    else:
        bundled = Path(pgserver.__file__).parent / "pginstall" / "bin" / name
        candidates.append(bundled)
        wheel = f"not in the pgserver wheel ({bundled})" if not bundled.exists() else ""
    seen = []
    for path in candidates:
        if not os.access(path, os.X_OK):
            continue
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30).stdout
        found = re.search(r"\b(\d+)(?:\.\d+)?", out)
        major = int(found.group(1)) if found else 0
        if major >= server_major:
            return path
        seen.append(f"{path} is PostgreSQL {major}")
    pytest.fail(f"{name} of PostgreSQL {server_major} or newer is missing (the server is {server_major}): "
                f"{'; '.join(seen) or 'none on PATH'}{'; ' + wheel if wheel else ''}. Install the PostgreSQL client "
                f"(Debian: apt-get install postgresql-client-{server_major}) or the pgserver wheel "
                "(pip install -e '.[embedded]').")


def submitted(job_id: str) -> JobSubmitted:
    return JobSubmitted(spec=JobSpec(job_id=job_id, team="team-a", queue="team-a",
                                     pod_sets=(PodSet(count=1, gpus_per_pod=8),), max_runtime_s=600,
                                     labels={"sim.gpuq.io/duration-s": "60"}), submitted_at=T0)


async def run_jobs(stack: Stack, nats_url: str, job_ids: list[str]) -> None:
    """Submit the jobs and wait until each has run to completion and its end is in the ledger and audit trail."""
    nc = await nats.connect(nats_url)
    try:
        for job_id in job_ids:
            await publish_event(nc.jetstream(), make_event(submitted(job_id), source="test", time=T0),
                                JobSubmitted.scoped_subject("team-a"))
    finally:
        await nc.close()
    assert stack.pool is not None
    async with stack.pool.acquire() as conn:
        for _ in range(600):
            done = await conn.fetchval(
                "SELECT count(*) FROM executor.runs r JOIN metering.job_facts f ON f.job_id = r.job_id "
                "AND f.kind = 'completed' WHERE r.status = 'completed' AND r.job_id = ANY($1::text[])", job_ids)
            audited = await conn.fetchval("SELECT count(DISTINCT job_id) FROM audit.records "
                                          "WHERE action = 'place' AND job_id = ANY($1::text[])", job_ids)
            if done == len(job_ids) and audited == len(job_ids):
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"jobs {job_ids} did not complete")


async def contents(url: str) -> list[list[tuple[object, ...]]]:
    conn = await asyncpg.connect(url)
    try:
        return [[tuple(r) for r in await conn.fetch(query)] for query in COMPARED]
    finally:
        await conn.close()


async def test_a_pg_dump_of_gpuqs_schemas_restored_into_a_fresh_database_serves_the_platform(
        fresh: tuple[str, str], make_database: Callable[[str], Awaitable[str]], tmp_path: Path) -> None:
    nats_url, database_url = fresh
    conn = await asyncpg.connect(database_url)
    server_major = int(await conn.fetchval("SHOW server_version_num")) // 10_000
    await conn.close()
    pg_dump, pg_restore = pg_tool("pg_dump", server_major), pg_tool("pg_restore", server_major)

    def settings(url: str) -> StackSettings:
        return StackSettings(nats_url=nats_url, database_url=url, queues=QUEUES, cluster=CLUSTER, services=SERVICES,
                             clock=ScaledClock(100.0))

    async with Stack(settings(database_url)) as stack:
        await run_jobs(stack, nats_url, ["before-1", "before-2"])
    before = await contents(database_url)
    assert [len(rows) for rows in before[:2]] == [2, 2] and before[3]

    # The backup, as docs/install.md gives it: gpuq's schemas only, custom format.
    dump = tmp_path / "gpuq.dump"
    res = await asyncio.to_thread(
        subprocess.run, [str(pg_dump), "--format=custom", "--file", str(dump),
                         *(f"--schema={s}" for s in GPUQ_SCHEMAS), database_url],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    restored_url = await make_database("restored")
    res = await asyncio.to_thread(
        subprocess.run, [str(pg_restore), "--no-owner", "--exit-on-error", "--single-transaction",
                         "--dbname", restored_url, str(dump)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert await contents(restored_url) == before

    # The services start on the restored database (nothing left to migrate) and the platform goes on: the old jobs
    # are there, a new one runs, and the audit trail refuses changes as before.
    async with Stack(settings(restored_url)) as stack:
        report = await stack.health()
        assert report.ready, report.model_dump()
        await run_jobs(stack, nats_url, ["after-1"])
        assert stack.pool is not None
        async with stack.pool.acquire() as conn:
            statuses = dict(await conn.fetch("SELECT job_id, status FROM executor.runs"))
            assert statuses == {"before-1": "completed", "before-2": "completed", "after-1": "completed"}
            with pytest.raises(asyncpg.RaiseError, match="append-only"):
                await conn.execute("DELETE FROM audit.records WHERE job_id = 'before-1'")
            assert await conn.fetchval("SELECT count(*) FROM audit.partitions") >= 1


# The reconciliation after a restore: a cluster with room for every job at once, so that what runs when is decided by
# the test, not by the queue.
WIDE = parse_cluster({"node_groups": [
    {"name": "a100", "count": 6, "gpus_per_node": 8, "gpu_model": "A100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576, "nodes_per_rack": 2},
]})
WIDE_QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"A100-80GB": {"nominal": 48}}}],
    "gpu_flavors": {"A100-80GB": {"cost_per_gpu_hour": 2.0}},
})
# The job events each job carries once on the bus from the restart on, by what it was at the backup's moment.
AFTER_RESTART = {
    "inflight": ("io.gpuq.job.completed.v1",),  # running at the backup: the restored run ends, once
    "after": ("io.gpuq.job.admitted.v1", "io.gpuq.job.placed.v1", "io.gpuq.job.started.v1",
              "io.gpuq.job.completed.v1"),  # submitted after it, handled by the lost database: again, once
    "down": ("io.gpuq.job.admitted.v1", "io.gpuq.job.placed.v1", "io.gpuq.job.started.v1",
             "io.gpuq.job.completed.v1"),  # submitted while the platform was down: once
    "before": (),  # done before the backup: nothing
}
JOB_TYPES = ("io.gpuq.job.admitted.v1", "io.gpuq.job.placed.v1", "io.gpuq.job.started.v1", "io.gpuq.job.completed.v1",
             "io.gpuq.job.failed.v1", "io.gpuq.job.rejected.v1", "io.gpuq.job.preempted.v1")


async def publish_jobs(nats_url: str, durations: dict[str, int]) -> None:
    nc = await nats.connect(nats_url)
    try:
        for job_id, duration_s in durations.items():
            spec = JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=8),),
                           max_runtime_s=7200, labels={"sim.gpuq.io/duration-s": str(duration_s)})
            await publish_event(nc.jetstream(), make_event(JobSubmitted(spec=spec, submitted_at=T0), source="test",
                                                           time=T0), JobSubmitted.scoped_subject("team-a"))
    finally:
        await nc.close()


async def wait_until(url: str, query: str, ids: list[str], timeout_s: float = 120.0) -> None:
    """Until `query` (with $1 the ids) counts every one of `ids`."""
    conn = await asyncpg.connect(url)
    try:
        for _ in range(int(timeout_s * 10)):
            if await conn.fetchval(query, ids) == len(ids):
                return
            await asyncio.sleep(0.1)
        runs = dict(await conn.fetch("SELECT job_id, status FROM executor.runs"))
        facts = [tuple(r) for r in await conn.fetch("SELECT job_id, kind FROM metering.job_facts ORDER BY job_id")]
    finally:
        await conn.close()
    raise AssertionError(f"not every one of {ids}: {query}; runs {runs}; metering's facts {facts}")


async def stream_events(nats_url: str, subject: str, from_seq: int = 1, upto: int | None = None
                        ) -> list[dict[str, object]]:
    """The events of the stream that holds `subject`, from sequence `from_seq` to `upto` (default: its end)."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        name = stream_for_subject(subject).name
        last = (await js.stream_info(name)).state.last_seq if upto is None else upto
        return [json.loads((await js.get_msg(name, seq)).data or b"{}") for seq in range(from_seq, last + 1)]
    finally:
        await nc.close()


async def stream_last_seq(nats_url: str, subject: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        return int((await nc.jetstream().stream_info(stream_for_subject(subject).name)).state.last_seq)
    finally:
        await nc.close()


def gpuq(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "gpuq"), *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


RUNNING = "SELECT count(*) FROM executor.runs WHERE status = 'running' AND job_id = ANY($1::text[])"
COMPLETED = "SELECT count(*) FROM executor.runs WHERE status = 'completed' AND job_id = ANY($1::text[])"


async def test_after_a_restore_and_reconcile_bus_the_platform_handles_each_job_exactly_once(
        fresh: tuple[str, str], make_database: Callable[[str], Awaitable[str]], tmp_path: Path) -> None:
    """A backup taken while jobs run; after it, jobs are submitted and run, and the ones running end, recorded only in
    the database that is then lost (the platform stops at once, its ledger a little behind); one more is submitted
    while it is down. Restored from the backup, `gpuq reconcile-bus --since <the backup's moment>`, restarted on the
    same bus: every job ends exactly once in the restored platform, those the lost database had handled after the
    backup included, and the audit trail holds what the lost database recorded too."""
    nats_url, database_url = fresh
    conn = await asyncpg.connect(database_url)
    server_major = int(await conn.fetchval("SHOW server_version_num")) // 10_000
    await conn.close()
    pg_dump, pg_restore = pg_tool("pg_dump", server_major), pg_tool("pg_restore", server_major)
    clock = ScaledClock(100.0)  # one clock for both runs: the restored platform's time goes on from the first's

    def settings(url: str) -> StackSettings:
        return StackSettings(nats_url=nats_url, database_url=url, queues=WIDE_QUEUES, cluster=WIDE,
                             services=SERVICES, clock=clock)

    groups = {"before": ["b-1", "b-2"], "inflight": ["i-1", "i-2"], "after": ["a-1", "a-2"], "down": ["d-1"]}
    dump = tmp_path / "gpuq.dump"
    # Where the reconciliation starts: the backup's moment minus a margin, here one that reaches back past every job,
    # so that what the backup holds is published again too (and recognised, not handled again).
    since = datetime.now(UTC) - timedelta(seconds=1)
    async with Stack(settings(database_url)) as stack:
        await publish_jobs(nats_url, dict.fromkeys(groups["before"], 60))
        await wait_until(database_url, COMPLETED, groups["before"])
        await publish_jobs(nats_url, dict.fromkeys(groups["inflight"], 1200))  # 12 s here
        await wait_until(database_url, RUNNING, groups["inflight"])
        # The backup, while they run (one consistent snapshot).
        res = await asyncio.to_thread(
            subprocess.run, [str(pg_dump), "--format=custom", "--file", str(dump),
                             *(f"--schema={s}" for s in GPUQ_SCHEMAS), database_url],
            capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        await publish_jobs(nats_url, dict.fromkeys(groups["after"], 60))
        await wait_until(database_url, COMPLETED, groups["after"] + groups["inflight"])
        assert stack.pool is not None
    # The database is lost here. Jobs are submitted while the platform is down.
    await publish_jobs(nats_url, dict.fromkeys(groups["down"], 60))
    restored_url = await make_database("reconciled")
    res = await asyncio.to_thread(
        subprocess.run, [str(pg_restore), "--no-owner", "--exit-on-error", "--single-transaction",
                         "--dbname", restored_url, str(dump)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    restart_seq = await stream_last_seq(nats_url, JobSubmitted.subject()) + 1
    before_restart = {str(e["id"]) for e in await stream_events(nats_url, JobSubmitted.subject())}
    audited = {str(e["id"]) for e in await stream_events(nats_url, AuditRecorded.subject())}

    # The reconciliation, with the services stopped, then the services on the restored database.
    env = {"NATS_URL": nats_url, "DATABASE_URL": restored_url}
    reconciled = await asyncio.to_thread(gpuq, "reconcile-bus", "--since", since.isoformat(), env=env)
    assert reconciled.returncode == 0, reconciled.stdout + reconciled.stderr
    print(reconciled.stdout)
    async with Stack(settings(restored_url)) as stack:
        every = [j for ids in groups.values() for j in ids]
        await wait_until(restored_url, COMPLETED, every)
        await wait_until(restored_url, "SELECT count(*) FROM admission.jobs WHERE status = 'finished' "
                                       "AND job_id = ANY($1::text[])", every)
        await wait_until(restored_url, "SELECT count(DISTINCT job_id) FROM metering.job_facts WHERE kind = 'completed' "
                                       "AND job_id = ANY($1::text[])", every)
        assert stack.pool is not None
        async with stack.pool.acquire() as conn:
            assert dict(await conn.fetch("SELECT job_id, status FROM admission.jobs")) == dict.fromkeys(every,
                                                                                                        "finished")
            facts = await conn.fetch("SELECT job_id, count(*) AS n FROM metering.job_facts WHERE kind = 'completed' "
                                     "GROUP BY job_id")
            assert {r["job_id"]: r["n"] for r in facts} == dict.fromkeys(every, 1)
            for schema in SERVICES:
                assert await conn.fetchval(f"SELECT count(*) FROM {schema}.dead_letters") == 0, schema
            # The audit trail: every record the lost platform published is there (history), once.
            for _ in range(300):
                stored = {r["event_id"] for r in await conn.fetch("SELECT event_id FROM audit.records")}
                if stored >= audited:
                    break
                await asyncio.sleep(0.1)
            assert audited - stored == set()
            assert await conn.fetchval("SELECT count(*) - count(DISTINCT event_id) FROM audit.records") == 0
        # Not while the services consume: it says so and changes nothing.
        refused = await asyncio.to_thread(gpuq, "reconcile-bus", "--since", since.isoformat(), env=env)
        assert refused.returncode == 2 and "stop them first" in refused.stdout, refused.stdout + refused.stderr
    # What the restored platform decided, on the bus (events it published, not the copies of what was there before):
    # each job's remaining steps once, nothing twice.
    counts = Counter((str(e["type"]), str(e["subject"]))
                     for e in await stream_events(nats_url, JobSubmitted.subject(), restart_seq)
                     if e["type"] in JOB_TYPES and e["id"] not in before_restart)
    want = Counter({(t, j): 1 for group, ids in groups.items() for j in ids for t in AFTER_RESTART[group]})
    assert counts == want
    assert "warning" not in reconciled.stdout, reconciled.stdout
    assert re.search(r"\d+ requests", reconciled.stdout) and re.search(r"\d+ restored decisions", reconciled.stdout) \
        and re.search(r"left out \(only the lost database decided them\): [1-9]", reconciled.stdout), reconciled.stdout
