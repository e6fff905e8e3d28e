"""Reports agree (issue 51): the demo's report, `gpuq report --by team` and the metering table give one team the
same GPU-hours. The demo's table summed the executor's runs (the latest run of each job only, from its start) and
showed 357 where the metering ledger said 400; a job preempted and resumed is what tells them apart."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime
from types import SimpleNamespace

import nats

import cli.platform as platform
from services.api.readmodel import fetch_status
from services.metering.report import report_document
from services.metering.store import team_summary
from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.domain import JobSpec
from shared.events import JobSubmitted, make_event
from shared.service import publish_event
from tests.system.reclaim_story import wait_until
from tests.system.test_preemptor_gets_freed_gpus import CLUSTER, QUEUES, job_spec


async def test_the_demo_report_and_gpuq_report_agree_on_a_teams_gpu_hours(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    clock = ScaledClock(100.0)
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("admission", "scheduler", "preemption", "executor", "metering"), clock=clock)
    async with Stack(settings) as stack:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()

        async def submit(spec: JobSpec) -> None:
            now = datetime.fromtimestamp(clock.now(), UTC)
            await publish_event(js, make_event(JobSubmitted(spec=spec, submitted_at=now), source="test", time=now),
                                JobSubmitted.scoped_subject(spec.team))

        async def is_(job_id: str, wanted: str) -> bool:
            rows = await fetch_status(database_url, job_id)
            return bool(rows) and rows[0]["state"] == wanted

        origin = clock.now()
        await submit(job_spec("a-low", "team-a", "low", 400, checkpoint=True))
        await wait_until(lambda: is_("a-low", "running"))
        await asyncio.sleep(1.0)  # past the protection window: a-low is preempted, and resumes later
        await submit(job_spec("a-high", "team-a", "high", 100))
        for job_id in ("a-high", "a-low"):
            await wait_until(lambda job_id=job_id: is_(job_id, "completed"))  # type: ignore[misc]  # bound per loop
        await asyncio.sleep(0.5)  # metering consumes the completions after the executor wrote them
        end = clock.now()
        # The demo's report, as `gpuq up` prints it at the end of a run
        with platform.console.capture() as captured:
            await platform._report(database_url, CLUSTER.total_gpus, origin, end,
                                   SimpleNamespace(runtimes=[]))  # type: ignore[arg-type]  # only its counters
        await nc.close()
        assert stack is not None

    text = captured.get()
    # the first table's team-a row (the metering table below it has one too); its last column is the GPU-hours
    rows = [[c.strip() for c in re.split(r"[│┃|]|\s{2,}", line) if c.strip()] for line in text.splitlines()]
    demo_a = next(float(cells[-1]) for cells in rows if cells and cells[0] == "team-a")
    report = await report_document(database_url, by="team", now=datetime.now(UTC))
    by_report = {r["team"]: r["allocated_gpu_hours"] for r in report["rows"]}
    by_metering = {r["team"]: r["allocated_gpu_hours"] for r in await team_summary_of(database_url)}
    assert by_report["team-a"] > 0
    assert by_report == by_metering
    assert demo_a == round(by_report["team-a"], 1), text


async def team_summary_of(database_url: str) -> list[dict]:
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        return await team_summary(conn)
    finally:
        await conn.close()
