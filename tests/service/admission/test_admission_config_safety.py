"""Mistakes caught before they land, on real NATS + Postgres: admission refuses a queue configuration change that
raises a guarantee past the live cluster's capacity, names a GPU model the cluster lacks, or removes a queue that
holds jobs, whatever path it came by (here a direct publish, as a pipeline or a forged command could), unless it is
forced, which the audit trail records. With no node announced yet it applies such a change with a warning. A job
asking for no GPU is rejected with the reason. `gpuq apply-queues --dry-run` (admin mode) prints the same verdict."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import nats
import pytest_asyncio
import yaml
from typer.testing import CliRunner

from cli.main import app
from services.admission.app import AdmissionService
from services.scheduler.nodes import MIGRATIONS as SCHEDULER_MIGRATIONS
from services.scheduler.nodes import record_node
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import apply_migrations, create_pool
from shared.domain import JobSpec, NodeSpec, PodSet
from shared.events import JobSubmitted, QueueConfigChanged, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

T0 = datetime(2026, 1, 1, tzinfo=UTC)
H100 = "H100-80GB"


def queues(nominal: int = 8, *, extra: dict[str, int] | None = None, team_b: bool = True) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "priority_classes": [{"name": "normal", "value": 100}],
        "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {H100: {"nominal": nominal},
                                                                      **{m: {"nominal": n}
                                                                         for m, n in (extra or {}).items()}}}]}
    if team_b:
        doc["queues"].append({"name": "team-b", "teams": ["team-b"], "quotas": {H100: {"nominal": 8}}})
    return doc


def submitted(job_id: str, team: str, gpus: int) -> bytes:
    spec = JobSpec(job_id=job_id, team=team, queue=team, pod_sets=(PodSet(count=1, gpus_per_pod=gpus),))
    return encode_event(make_event(JobSubmitted(spec=spec, submitted_at=T0), source="test", time=T0))


def change(doc: dict[str, Any], *, force: bool = False) -> bytes:
    return encode_event(make_event(QueueConfigChanged(config=doc, changed_by="alice", force=force or None),
                                   source="test", time=T0))


async def until(check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


class Admission:
    """An admission service on team-a's and team-b's 8 H100 each, with a connection to its database."""

    def __init__(self, nats_url: str, database_url: str, conn: asyncpg.Connection, js: Any) -> None:
        self.nats_url, self.database_url, self.conn, self.js = nats_url, database_url, conn, js

    async def audit(self, action: str) -> list[dict[str, Any]]:
        rows = await self.conn.fetch("SELECT detail FROM admission.audit WHERE action = $1 ORDER BY id", action)
        return [json.loads(r["detail"]) for r in rows]

    async def versions(self) -> int:
        return int(await self.conn.fetchval("SELECT count(*) FROM admission.config"))

    async def status(self, job_id: str) -> str | None:
        return await self.conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id)

    async def propose(self, doc: dict[str, Any], *, force: bool = False) -> None:
        await self.js.publish(ns_subject("queue.config_changed"), change(doc, force=force))

    async def settled(self, count: int) -> None:
        """Wait until `count` proposals were decided (applied, refused or unchanged): committed verdicts."""
        async def decided() -> bool:
            n = await self.conn.fetchval("SELECT count(*) FROM admission.audit WHERE action IN "
                                         "('config_applied', 'config_refused', 'config_unchanged') "
                                         "AND detail->>'source' IS DISTINCT FROM 'file'")
            return bool(n >= count)
        await until(decided)


@pytest_asyncio.fixture
async def admission(fresh: tuple[str, str]) -> AsyncIterator[Admission]:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    svc = ServiceRuntime(AdmissionService(parse_queues(queues())).spec(), nats_url=nats_url, pool=pool,
                         clock=ManualClock(), database_url=database_url)
    await svc.start()
    try:
        yield Admission(nats_url, database_url, conn, nc.jetstream())
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def announce(conn: asyncpg.Connection, nodes: int, gpus: int = 8) -> None:
    """The cluster as the executors announced it: the scheduler's node table (its read model's source)."""
    for i in range(nodes):
        await record_node(conn, NodeSpec(name=f"n{i}", gpus=gpus, gpu_model=H100, cpu_milli=96000,
                                         memory_mib=1 << 20, rack="r0", block="b0"), at=0.0)


async def scheduler_tables(database_url: str) -> None:
    pool = await create_pool(database_url, min_size=1, max_size=1)
    try:
        await apply_migrations(pool, "scheduler", SCHEDULER_MIGRATIONS)
    finally:
        await pool.close()


async def test_mistakes_are_refused_at_admission_unless_forced_and_forcing_is_audited(admission: Admission) -> None:
    a = admission
    await scheduler_tables(a.database_url)
    await announce(a.conn, 32)  # 256 H100
    for job_id, gpus in (("a1", 8), ("a2", 8)):
        await a.js.publish(ns_subject("job.submitted.team-a"), submitted(job_id, "team-a", gpus))
    await a.js.publish(ns_subject("job.submitted.team-b"), submitted("b1", "team-b", 8))
    await until(lambda: _is(a.status("a2"), "pending"))
    await until(lambda: _is(a.status("b1"), "admitted"))

    # A guarantee of 1,280 H100 on a 256-H100 cluster: refused, and a2 is NOT admitted against the phantom quota.
    await a.propose(queues(1280))
    await a.settled(1)
    [refused] = await a.audit("config_refused")
    assert "guaranteed H100-80GB sums to 1288 but the cluster has 256" in refused["error"], refused
    assert "--force" in refused["error"]
    assert await a.versions() == 1 and await a.status("a2") == "pending"

    # A quota for a GPU model the cluster does not have: refused.
    await a.propose(queues(8, extra={"B200": 64}))
    await a.settled(2)
    assert "quota for GPU model B200, which the cluster does not have (it has: H100-80GB)" in \
        (await a.audit("config_refused"))[1]["error"]

    # Removing team-b while b1 runs: refused, naming what it holds.
    await a.propose(queues(8, team_b=False))
    await a.settled(3)
    assert "removes queue team-b, which holds 1 admitted (running) and 0 pending job(s)" in \
        (await a.audit("config_refused"))[2]["error"]
    assert await a.versions() == 1

    # A change within capacity goes through, with its diff in the record.
    await a.propose(queues(16))
    await until(lambda: _is(a.status("a2"), "admitted"))
    applied = (await a.audit("config_applied"))[-1]
    assert applied["diff"] == ["~ queue team-a: H100-80GB 8 → 16"] and "forced" not in applied

    # Forced: applied, and the record says it was forced and what it overrode.
    await a.propose(queues(1280), force=True)
    await a.settled(5)
    forced = (await a.audit("config_applied"))[-1]
    assert forced["forced"] is True and await a.versions() == 3
    assert any("sums to 1288 but the cluster has 256" in o for o in forced["overridden"]), forced
    assert len(await a.audit("config_refused")) == 3


async def test_with_no_node_announced_capacity_is_a_warning_and_the_change_applies(admission: Admission) -> None:
    """A first install applies its queues before any executor has announced a node: no refusal on capacity."""
    a = admission
    await a.propose(queues(1280, extra={"B200": 8}))
    await a.settled(1)
    assert await a.audit("config_refused") == [] and await a.versions() == 2
    warnings = (await a.audit("config_applied"))[-1]["warnings"]
    assert any("no node announced yet" in w for w in warnings), warnings


async def test_a_pending_job_keeps_its_queue_and_a_cluster_that_shrank_blocks_no_unrelated_change(
        admission: Admission) -> None:
    a = admission
    await scheduler_tables(a.database_url)
    await announce(a.conn, 1)  # 8 H100; team-a and team-b are guaranteed 16: already above (the cluster shrank)
    await a.js.publish(ns_subject("job.submitted.team-b"), submitted("b1", "team-b", 8))
    await a.js.publish(ns_subject("job.submitted.team-b"), submitted("b2", "team-b", 8))
    await until(lambda: _is(a.status("b2"), "pending"))
    # Same guarantees, a weight changed: applied, the overcommit a warning.
    doc = queues()
    doc["queues"][0]["weight"] = 2
    await a.propose(doc)
    await a.settled(1)
    assert await a.audit("config_refused") == [] and await a.versions() == 2
    assert any("sums to 16 but the cluster has 8" in w for w in (await a.audit("config_applied"))[-1]["warnings"])
    # team-b holds a pending and an admitted job: not removed.
    await a.propose(queues(8, team_b=False))
    await a.settled(2)
    [refused] = await a.audit("config_refused")
    assert "removes queue team-b, which holds 1 admitted (running) and 1 pending job(s)" in refused["error"]


async def test_a_job_asking_for_no_gpu_is_rejected_with_the_reason(admission: Admission) -> None:
    a = admission
    await a.js.publish(ns_subject("job.submitted.team-a"), submitted("cpu-only", "team-a", 0))
    await until(lambda: _is(a.status("cpu-only"), "rejected"))
    row = await a.conn.fetchrow("SELECT reason, message FROM admission.jobs WHERE job_id = 'cpu-only'")
    assert row["reason"] == "NoGpuRequested" and "gpuq schedules GPU jobs" in row["message"], dict(row)


async def test_apply_queues_dry_run_prints_the_diff_and_refusals_and_applies_nothing(
        admission: Admission, tmp_path: Path) -> None:
    a = admission
    await scheduler_tables(a.database_url)
    await announce(a.conn, 32)
    await a.js.publish(ns_subject("job.submitted.team-b"), submitted("b1", "team-b", 8))
    await until(lambda: _is(a.status("b1"), "admitted"))
    doc = queues(1280, team_b=False)
    (tmp_path / "queues.yaml").write_text(yaml.safe_dump(doc))
    env = {"DATABASE_URL": a.database_url, "NATS_URL": a.nats_url, "GPUQ_API_URL": "", "COLUMNS": "300"}

    def gpuq(*args: str) -> Any:
        return CliRunner().invoke(app, ["apply-queues", str(tmp_path / "queues.yaml"), *args], env=env)

    dry = await asyncio.to_thread(gpuq, "--dry-run")
    assert dry.exit_code == 1, dry.output
    assert "~ queue team-a: H100-80GB 8 → 1280" in dry.output and "- queue team-b" in dry.output, dry.output
    assert "refused: guaranteed H100-80GB sums to 1280 but the cluster has 256" in dry.output
    assert "refused: removes queue team-b, which holds 1 admitted (running)" in dry.output
    assert "dry run: nothing applied" in dry.output
    plain = await asyncio.to_thread(gpuq, "--wait", "0")
    assert plain.exit_code == 1 and "not applied" in plain.output, plain.output
    forced = await asyncio.to_thread(gpuq, "--force", "--wait", "30")
    assert forced.exit_code == 0, forced.output
    assert "overridden (--force)" in forced.output and "configuration: version 2" in forced.output
    assert (await a.audit("config_applied"))[-1]["forced"] is True
    # Neither the dry run nor the refused command published anything: admission, which decides proposals in
    # order, decided none before the forced one.
    assert await a.audit("config_refused") == []


async def _is(value: Any, wanted: Any) -> bool:
    return bool(await value == wanted)
