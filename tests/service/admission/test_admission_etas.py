"""Admission's ETAs on real NATS + Postgres: the forward simulation runs off the handler lock, in a worker thread on a
copy of the state, and what it computed reaches the table and the status stream for the jobs that wait."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import asyncpg
import nats

from services.admission.app import AdmissionService
from services.eta.platform import PlatformEta
from shared.clock import ManualClock
from shared.config import parse_cluster, parse_queues
from shared.db import create_pool
from shared.events import JobPending, JobStarted, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime
from tests.service.admission.test_admission_service import queues, submitted, until
from tests.support.cluster import record_nodes

T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def test_waiting_jobs_get_etas_from_the_forward_simulation_off_the_lock(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    service = AdmissionService(parse_queues(queues(8)), eta=PlatformEta(), eta_interval_s=0.1)
    clock = ManualClock(T0.timestamp())
    runtime = ServiceRuntime(service.spec(), nats_url=nats_url, pool=pool, clock=clock, database_url=database_url)
    nodes = parse_cluster({"node_groups": [{"name": "h100", "count": 1, "gpus_per_node": 8, "gpu_model": "H100",
                                            "cpu_milli": 64000, "memory_mib": 512000}]}).nodes()
    await runtime.start()
    try:
        await record_nodes(pool, nodes)  # the scheduler's fact: ETAs read its read model
        for job_id in ("first", "second", "third"):  # 8 GPUs of quota: the first runs, the others wait behind it
            await js.publish(ns_subject("job.submitted.team-a"), submitted(job_id, 8))
        await until(lambda: conn.fetchval("SELECT status = 'admitted' FROM admission.jobs WHERE job_id = 'first'"))
        await js.publish(ns_subject("job.started"), encode_event(make_event(
            JobStarted(job_id="first", started_at=T0, nodes=("h100-0",)), source="test", time=T0)))

        async def etas() -> dict[str, float]:
            rows = await conn.fetch("SELECT job_id, eta FROM admission.jobs WHERE eta IS NOT NULL")
            return {r["job_id"]: r["eta"] for r in rows}

        async def both_have_etas() -> bool:
            clock.advance(60.0)  # ETAs refresh on the platform clock, not on wall seconds
            return {"second", "third"} <= set(await etas())

        await until(both_have_etas)
        found = await etas()
        # behind the running first job: the second not before the first's limit runs out, the third not before it
        assert T0.timestamp() < found["second"] <= found["third"]
        # announced in the same transaction: JobPending with the ETA, on the status subject
        rows = await conn.fetch("SELECT body FROM admission.outbox WHERE subject = $1 ORDER BY seq",
                                ns_subject("status.job.pending"))
        announced = {p.job_id: p for p in (JobPending.model_validate(json.loads(r["body"])["data"]) for r in rows)
                     if p.eta is not None}
        # (the first may have been given one too while it waited for placement: the first refresh is immediate)
        assert {"second", "third"} <= set(announced)
        assert announced["second"].eta is not None and announced["second"].eta.timestamp() == found["second"]
    finally:
        await runtime.stop()
        await nc.close()
        await conn.close()
        await pool.close()

