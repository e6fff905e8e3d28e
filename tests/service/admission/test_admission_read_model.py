"""Admission's read model (admission.v1_jobs through services/admission/readmodel.py): what other services read of
a job's admission (the preemption service: a preemptor's spec, whether it still waits, its flavors) instead of
mirroring JobSubmitted / JobAdmitted / the end events, on a real admission service fed over NATS."""

from __future__ import annotations

import asyncpg
import nats

from services.admission import readmodel
from services.admission.app import AdmissionService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.events import JobCompleted, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime
from tests.service.admission.test_admission_service import T0, queues, submitted, until


async def test_a_job_as_admission_knows_it(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    conn = await asyncpg.connect(database_url)
    assert await readmodel.job(conn, "j1") is None  # before the owner ever ran here: nobody is known
    pool = await create_pool(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = ServiceRuntime(AdmissionService(parse_queues(queues(8))).spec(), nats_url=nats_url, pool=pool,
                         clock=ManualClock(), database_url=database_url)
    await svc.start()
    try:
        for job_id in ("j1", "j2"):
            await js.publish(ns_subject("job.submitted.team-a"), submitted(job_id, 8))

        async def judged() -> bool:
            return {f.status for f in (await readmodel.jobs(conn, ["j1", "j2"])).values()} == {"admitted", "pending"}

        await until(judged)
        facts = await readmodel.jobs(conn, ["j1", "j2", "unknown"])
        assert sorted(facts) == ["j1", "j2"]
        assert (facts["j1"].status, facts["j1"].allowed_models) == ("admitted", ("H100",))
        assert (facts["j2"].status, facts["j2"].allowed_models, facts["j2"].flavors) == ("pending", (), {})
        assert facts["j2"].spec.job_id == "j2" and facts["j2"].queue == "team-a"
        await js.publish(ns_subject("job.completed"), encode_event(make_event(
            JobCompleted(job_id="j1", finished_at=T0), source="test", time=T0)))

        async def done() -> bool:
            fact = await readmodel.job(conn, "j1")
            return fact is not None and fact.status == "finished"

        await until(done)
        assert "finished" not in readmodel.WAITING
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()
