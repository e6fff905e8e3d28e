"""Issue 43, item 2, replayed on admission with real NATS and Postgres: 1,500 submissions from one team with a NUL
character in a label (JSON allows it, Postgres cannot store it) stalled every team's submissions for over a minute,
on every try. Each failed in Postgres at the end of its batch, so every batch was handled again one submission at a
time, and each bad one was retried eight times over ~40 s of backoff while holding one of the consumer's 1,000
places for unacknowledged messages: nothing behind them was delivered until they were dead-lettered.

Now they are refused when read (InvalidPayload, naming the field) and dead-lettered on their first delivery, and
another team's submission published after all of them is admitted."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import nats

from services.admission.app import AdmissionService
from shared.bus import stream_for_subject
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import JobSubmitted, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

T0 = datetime(2026, 1, 1, tzinfo=UTC)
QUEUES = {"priority_classes": [{"name": "normal", "value": 100}],
          "queues": [{"name": team, "teams": [team], "quotas": {"H100": {"nominal": 8}}}
                     for team in ("team-a", "team-b")]}
FLOOD = 1500


def submission(job_id: str, team: str, labels: dict[str, str]) -> bytes:
    spec = JobSpec(job_id=job_id, team=team, queue=team, pod_sets=(PodSet(count=1, gpus_per_pod=1),))
    body = encode_event(make_event(JobSubmitted(spec=spec, submitted_at=T0), source="test", time=T0))
    # Written into the body as a producer would: the models refuse to make such a spec themselves.
    return body.replace(b'"labels":{}', b'"labels":{' + b",".join(
        b'"%s":"%s"' % (k.encode(), v.encode()) for k, v in labels.items()) + b"}")


async def until(check, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_a_flood_of_submissions_postgres_cannot_store_does_not_delay_another_team(
        fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    runtime = ServiceRuntime(AdmissionService(parse_queues(QUEUES)).spec(), nats_url=nats_url, pool=pool,
                             clock=ManualClock(), database_url=database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await runtime.start()
    try:
        acks = [await js.publish_async(ns_subject("job.submitted.team-b"),
                                       submission(f"poison-{i}", "team-b", {"owner": "a\\u0000b"}))
                for i in range(FLOOD)]
        acks.append(await js.publish_async(ns_subject("job.submitted.team-a"),
                                           submission("canary", "team-a", {"owner": "alice"})))
        await asyncio.gather(*acks)

        async def canary_admitted() -> bool:
            return await pool.fetchval("SELECT status FROM admission.jobs WHERE job_id = 'canary'") == "admitted"

        await until(canary_admitted)
        await until(lambda: pool.fetchval("SELECT count(*) = $1 FROM admission.dead_letters", FLOOD))
        rows = await pool.fetch("SELECT reason, deliveries, count(*) AS n, min(message) AS message "
                                "FROM admission.dead_letters GROUP BY 1, 2")
        assert [(r["reason"], r["deliveries"], r["n"]) for r in rows] == [("InvalidPayload", 1, FLOOD)]
        assert "data.spec.labels.owner: contains a NUL" in rows[0]["message"]
        assert runtime.counters.retried == 0  # no redelivery, no backoff: nothing waited behind them
        assert await pool.fetchval("SELECT count(*) FROM admission.jobs WHERE team = 'team-b'") == 0
        jobs = stream_for_subject(ns_subject("job.submitted.team-a")).name
        durable = next(name for plan, name, _ in runtime.consumers if plan.stream.name == jobs)
        assert (await js.consumer_info(jobs, durable)).num_redelivered == 0
        assert (await runtime.health()).checks["consumers"].ok
    finally:
        await runtime.stop()
        await nc.close()
        await pool.close()
