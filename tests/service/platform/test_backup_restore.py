"""A backup of gpuq's Postgres schemas with `pg_dump`, restored with `pg_restore` into a fresh database on the real
server, serves the platform: the services start on it (their migrations already applied), the jobs, their runs, the
ledger and the audit trail are there, the audit trail is still append-only, and a new job runs through it.
docs/install.md, "Backups and restore"."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import nats
import pytest

from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.config import parse_cluster, parse_queues
from shared.domain import JobSpec, PodSet
from shared.events import JobSubmitted, make_event
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
