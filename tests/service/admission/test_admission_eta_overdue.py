"""An ETA that passes while its job still waits is refreshed at once (issue 51: an ETA shown in the past), not at
the next periodic refresh 300 platform seconds later: admission's ETA loop counts it as a change."""

from __future__ import annotations

import asyncio

import asyncpg
import nats

from services.admission.app import AdmissionService
from services.eta.platform import PlatformEta
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import JobSubmitted, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime
from tests.service.admission.test_admission_service import T0, queues, until
from tests.support.cluster import record_nodes
from tests.unit.telemetry.telemetry_builders import node

LIMIT_S = 200  # "first" holds the node for this long in the replay: "second" is expected 200 s from a refresh


class Counting(PlatformEta):
    """Records the platform time of every refresh (each ends with `remember` in the service's process)."""

    def __init__(self) -> None:
        super().__init__()
        self.refreshes: list[float] = []

    def remember(self, etas, queued, now):  # type: ignore[no-untyped-def]  # the parent's signature
        self.refreshes.append(now)
        return super().remember(etas, queued, now)


def _submitted(job_id: str) -> bytes:
    spec = JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=8),),
                   max_runtime_s=LIMIT_S)
    return encode_event(make_event(JobSubmitted(spec=spec, submitted_at=T0), source="test", time=T0))


async def test_a_passed_eta_is_refreshed_before_the_periodic_refresh(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    counting = Counting()
    svc = ServiceRuntime(AdmissionService(parse_queues(queues(8)), eta=counting, eta_interval_s=0.05).spec(),
                         nats_url=nats_url, pool=pool, clock=clock, database_url=database_url)

    async def eta() -> float | None:
        return await conn.fetchval("SELECT eta FROM admission.jobs WHERE job_id = 'second'")

    await svc.start()
    try:
        await record_nodes(pool, (node("h0"),))
        await js.publish(ns_subject("job.submitted.team-a"), _submitted("first"))
        await js.publish(ns_subject("job.submitted.team-a"), _submitted("second"))

        async def both_held() -> bool:
            return await conn.fetchval("SELECT count(*) FROM admission.jobs WHERE (job_id, status) IN "
                                       "(('first', 'admitted'), ('second', 'pending'))") == 2

        async def has_eta() -> bool:
            return await eta() is not None

        await until(both_held)
        clock.advance(60.0)  # past the least time between two refreshes: the arrivals are refreshed
        await until(has_eta)
        # Settle: a change since the last refresh is refreshed once 30 s have passed; step the clock until a step
        # brings no refresh (nothing else happens: "first" is admitted, never placed, as no scheduler runs).
        for _ in range(10):  # bounded: an ETA of "now" refreshed again every 30 s would never settle
            seen = len(counting.refreshes)
            clock.advance(30.0)
            await asyncio.sleep(0.5)
            if len(counting.refreshes) == seen:
                break
        else:
            raise AssertionError(f"the ETA loop refreshes at every step: {counting.refreshes}")
        last = counting.refreshes[-1]
        given = await eta()
        assert given is not None and given <= last + LIMIT_S + 1
        # The ETA passes; the periodic refresh is 300 s after the last one, but the passed ETA counts as a change
        # and is replaced within the loop's next look.
        clock.advance(max(given, clock.now()) - clock.now() + 31.0)
        assert clock.now() - last < 300

        async def refreshed() -> bool:
            now = await eta()
            return now is not None and now >= clock.now()

        await until(refreshed, timeout=5.0)
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()
