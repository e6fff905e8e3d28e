"""Poison on a real JetStream server and Postgres (issue 43): no body stops a consumer, no message that Postgres
refuses holds up the ones behind it, and /readyz tells when a consumer does not advance.

1. A poison pill (a small body nested 1,000 deep) raised RecursionError where nothing caught it: the consumer
   stopped for good, /readyz stayed green, and a restart did not help (the message came again).
2. A flood of messages that pass validation but fail in Postgres stalled everyone: each failed batch was handled
   again one message at a time, every bad message was retried eight times over ~40 s of backoff, and the
   consumer's 1,000 unacknowledged messages were all waiting out their backoff, so nothing behind them came."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import nats
import pytest
import pytest_asyncio
from nats.js.api import AckPolicy, ConsumerConfig

from shared.bus import stream_for_subject
from shared.clock import ManualClock
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import CloudEvent, JobSubmitted, encode_event, make_event
from shared.health import HealthServer, combine
from shared.namespace import subject as ns_subject
from shared.service import BISECT_PART, MAX_ACK_PENDING, ServiceRuntime, ServiceSpec, Tx, publish_event
from tests.service.plumbing.test_delivery import SCHEMA, T0, CountingService, count, wait_for

SUBJECT_A = "job.submitted.team-a"
SUBJECT_B = "job.submitted.team-b"


@pytest_asyncio.fixture
async def pool(fresh: tuple[str, str]) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(fresh[1])
    await p.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")  # this module's own schema, from an earlier test
    await p.execute(f"CREATE SCHEMA {SCHEMA}")
    await p.execute(f"CREATE TABLE {SCHEMA}.counts(job_id text PRIMARY KEY, n int NOT NULL)")
    await p.execute(f"CREATE TABLE {SCHEMA}.sizes(job_id text PRIMARY KEY, size smallint NOT NULL)")
    yield p
    await p.close()


def submitted(job_id: str, team: str = "team-a", **labels: str) -> CloudEvent:
    spec = JobSpec(job_id=job_id, team=team, queue=team, pod_sets=(PodSet(),), labels=labels)
    return make_event(JobSubmitted(spec=spec), source="test", time=T0)


async def publish_all(nats_url: str, messages: list[tuple[str, bytes]]) -> None:
    """Publish (subject below the namespace, body) in order, the acknowledgements awaited together."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        acks = [await js.publish_async(ns_subject(subject), body) for subject, body in messages]
        await asyncio.gather(*acks)
    finally:
        await nc.close()


async def dead_letters(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    return await pool.fetch(f"SELECT reason, message, deliveries, body FROM {SCHEMA}.dead_letters ORDER BY id")


async def _true(value: Any) -> bool:
    return bool(value)


# ------------------------------------------------------------------------------ 1. a poison pill


async def test_a_poison_pill_is_dead_lettered_and_the_consumer_goes_on(fresh: tuple[str, str],
                                                                       pool: asyncpg.Pool) -> None:
    """The bodies of issue 43 on a team's own submission subject, between good ones: each bad one is dead-lettered
    with its reason, every good one is handled, and the consumer reports itself advancing."""
    nats_url, _ = fresh
    runtime = ServiceRuntime(CountingService().spec(), nats_url=nats_url, pool=pool, clock=ManualClock())
    nul = submitted("nul").model_dump(mode="json")
    nul["data"]["spec"]["labels"] = {"team": "a\u0000b"}
    long_id = submitted("long-id").model_dump(mode="json")
    long_id["id"] = "x" * 5000  # the inbox's primary key: Postgres cannot index it
    bad = [b'{"a":' * 1000 + b"1" + b"}" * 1000,  # 6 KB, 1,000 deep: RecursionError in the JSON parser
           b"[" * 3000,
           json.dumps(nul).encode(),
           json.dumps(long_id).encode()]
    good = [encode_event(submitted(f"good-{i}")) for i in range(len(bad) + 1)]
    interleaved = [m for i, body in enumerate(bad) for m in ((SUBJECT_A, good[i]), (SUBJECT_B, body))]
    await publish_all(nats_url, [*interleaved, (SUBJECT_A, good[-1])])
    await runtime.start()
    try:
        await wait_for(lambda: _true(runtime.counters.handled == len(good) and runtime.counters.dead_lettered == 4))
        rows = await dead_letters(pool)
        assert [r["reason"] for r in rows] == ["TooDeep", "TooDeep", "InvalidPayload", "MalformedEnvelope"]
        assert "data.spec.labels.team: contains a NUL" in rows[2]["message"]
        assert rows[3]["message"].startswith("id: 5000 characters")
        assert all(r["deliveries"] == 1 for r in rows)
        assert [bytes(r["body"]) for r in rows] == bad  # kept whole, for a replay after a fix
        for i in range(len(good)):
            assert await count(pool, f"good-{i}") == 1
        health = await runtime.health()
        assert health.ready and health.checks["consumers"].ok, health
    finally:
        await runtime.stop()


# ------------------------------------------------------------------------------ 2. what Postgres refuses


class SizingService:
    """Records each job's `size` label in a smallint column, all of a batch's rows in one statement at its end (as
    admission writes the submissions it queued): a size that no smallint holds passes validation and fails the whole
    batch in Postgres. Counts the messages handled in a unit of their own (the per-message path)."""

    def __init__(self) -> None:
        self.alone: list[str] = []

    async def on_submitted(self, tx: Tx, event: CloudEvent, payload: JobSubmitted) -> None:
        if tx.deferred is None:
            self.alone.append(payload.spec.job_id)
        tx.scratch.setdefault("sizes", []).append((payload.spec.job_id, int(payload.spec.labels.get("size", "1"))))
        await tx.after_events("sizes", self.write)

    async def write(self, tx: Tx) -> None:
        rows = tx.scratch.pop("sizes", [])
        await tx.conn.execute(f"INSERT INTO {SCHEMA}.sizes(job_id, size) SELECT j, s::smallint FROM "
                              "unnest($1::text[], $2::bigint[]) AS u(j, s)", [r[0] for r in rows], [r[1] for r in rows])

    def spec(self, optimistic: bool) -> ServiceSpec:
        return ServiceSpec(name="plumbingtest", schema=SCHEMA, handlers={JobSubmitted: self.on_submitted},
                           optimistic_batches=optimistic)


@pytest.mark.parametrize("optimistic", [False, True], ids=["savepoints", "optimistic"])
async def test_a_batch_postgres_refuses_is_bisected_and_the_bad_messages_are_dead_lettered_at_once(
        fresh: tuple[str, str], pool: asyncpg.Pool, optimistic: bool) -> None:
    """Three bad messages among 200 in one pull: the batch fails as a whole (its end), is bisected, the good messages
    are committed in parts, only the bad ones' small parts go one by one, and each bad one is dead-lettered on its
    first delivery (`Unstorable`): no retry, no backoff for anyone."""
    nats_url, _ = fresh
    svc = SizingService()
    runtime = ServiceRuntime(svc.spec(optimistic), nats_url=nats_url, pool=pool, clock=ManualClock())
    bad_at = {17, 100, 183}
    await publish_all(nats_url, [
        (SUBJECT_B, encode_event(submitted(f"j-{i}", "team-b", size=str(10**6)))) if i in bad_at else
        (SUBJECT_A, encode_event(submitted(f"j-{i}", "team-a", size=str(i)))) for i in range(200)])
    await runtime.start()
    try:
        await wait_for(lambda: _true(runtime.counters.handled == 197 and runtime.counters.dead_lettered == 3))
        assert await pool.fetchval(f"SELECT count(*) FROM {SCHEMA}.sizes") == 197
        rows = await dead_letters(pool)
        assert [(r["reason"], r["deliveries"]) for r in rows] == [("Unstorable", 1)] * 3
        assert "smallint out of range" in rows[0]["message"]
        assert runtime.counters.retried == 0  # dead-lettered on their first delivery
        good_alone = [j for j in svc.alone if int(j.removeprefix("j-")) not in bad_at]
        assert len(good_alone) <= len(bad_at) * (BISECT_PART - 1)  # one by one: all 197 of them
    finally:
        await runtime.stop()


async def test_a_flood_postgres_refuses_does_not_hold_up_another_teams_submission(
        fresh: tuple[str, str], pool: asyncpg.Pool) -> None:
    """1,100 messages from one team that Postgres refuses, then another team's: the canary is handled, and every
    bad message was dead-lettered on its first delivery, none redelivered (once, 1,000 of them waited out their
    backoff holding every unacknowledged place of the consumer, and nothing behind them was delivered)."""
    nats_url, _ = fresh
    svc = SizingService()
    runtime = ServiceRuntime(svc.spec(True), nats_url=nats_url, pool=pool, clock=ManualClock())
    flood = [(SUBJECT_B, encode_event(submitted(f"b-{i}", "team-b", size="100000"))) for i in range(1100)]
    await publish_all(nats_url, [*flood, (SUBJECT_A, encode_event(submitted("canary")))])
    await runtime.start()
    try:
        await wait_for(lambda: pool.fetchval(f"SELECT count(*) = 1 FROM {SCHEMA}.sizes WHERE job_id = 'canary'"),
                       timeout=120)
        await wait_for(lambda: _true(runtime.counters.dead_lettered == 1100), timeout=60)
        rows = await pool.fetch(f"SELECT reason, deliveries, count(*) AS n FROM {SCHEMA}.dead_letters GROUP BY 1, 2")
        assert [(r["reason"], r["deliveries"], r["n"]) for r in rows] == [("Unstorable", 1, 1100)]
        assert runtime.counters.retried == 0
        nc = await nats.connect(nats_url)
        info = await nc.jetstream().consumer_info(stream_for_subject(ns_subject(SUBJECT_A)).name,
                                                  runtime.consumers[0][1])
        await nc.close()
        assert info.num_redelivered == 0
        assert info.config.max_ack_pending == MAX_ACK_PENDING
    finally:
        await runtime.stop()


async def test_a_consumer_made_with_the_default_limit_gets_more_room_in_place(
        fresh: tuple[str, str], pool: asyncpg.Pool) -> None:
    """A consumer made before MAX_ACK_PENDING (JetStream's default, 1,000 unacknowledged messages) is given it in
    place, keeping its position: what it had handled is not delivered again."""
    nats_url, _ = fresh
    runtime = ServiceRuntime(CountingService().spec(), nats_url=nats_url, pool=pool, clock=ManualClock())
    plan, durable, _ = runtime.consumers[0]
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await publish_event(js, submitted("before"), ns_subject(SUBJECT_A))
        await js.add_consumer(plan.stream.name, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT,
                                                               filter_subject=ns_subject("job.submitted.*")))
        assert (await js.consumer_info(plan.stream.name, durable)).config.max_ack_pending == 1000
        sub = await js.pull_subscribe_bind(durable, plan.stream.name)
        for m in await sub.fetch(1):
            await m.ack_sync()  # handled by the old consumer already
        await publish_event(js, submitted("after"), ns_subject(SUBJECT_A))
        await runtime.start()
        await wait_for(lambda: count(pool, "after"))
        assert await count(pool, "before") == 0
        assert (await js.consumer_info(plan.stream.name, durable)).config.max_ack_pending == MAX_ACK_PENDING
    finally:
        await runtime.stop()
        await nc.close()


# ------------------------------------------------------------------------------ /readyz tells the truth


async def test_readyz_and_metrics_name_a_consumer_that_does_not_advance(fresh: tuple[str, str],
                                                                       pool: asyncpg.Pool) -> None:
    """A handler that never returns: messages wait, the consumer does not advance, and after the stall threshold
    /readyz is not ready naming the consumer, and /metrics says it is stalled; once the handler returns, both are
    well again. A consumer loop that stopped is named at once."""
    nats_url, _ = fresh
    release = asyncio.Event()
    counting = CountingService()

    async def stuck_on_one(tx: Tx, event: CloudEvent, payload: JobSubmitted) -> None:
        if payload.spec.job_id == "stuck":
            await release.wait()
        await counting.on_submitted(tx, event, payload)

    spec = ServiceSpec(name="plumbingtest", schema=SCHEMA, handlers={JobSubmitted: stuck_on_one})
    runtime = ServiceRuntime(spec, nats_url=nats_url, pool=pool, clock=ManualClock())
    runtime.stall_after_s = 0.5
    durable = runtime.consumers[0][1]

    async def report(connections: bool = True) -> Any:
        return combine([await runtime.health(connections=connections)])

    await runtime.start()
    async with HealthServer(report, host="127.0.0.1", port=0) as server, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.bound_port}", timeout=10) as client:
        try:
            assert (await client.get("/readyz")).status_code == 200
            await publish_all(nats_url, [(SUBJECT_A, encode_event(submitted(j))) for j in ("stuck", "behind")])

            async def readyz_names_it() -> bool:
                r = await client.get("/readyz")
                detail = r.json()["services"]["plumbingtest"]["checks"]["consumers"]["detail"]
                return r.status_code == 503 and detail.startswith(f"{durable}: no progress for")

            await wait_for(readyz_names_it)
            metrics = (await client.get("/metrics")).text
            assert f'gpuq_consumer_stalled{{service="plumbingtest",consumer="{durable}"}} 1' in metrics
            assert f'gpuq_consumer_waiting_messages{{service="plumbingtest",consumer="{durable}"}} 2' in metrics
            assert 'gpuq_service_ready{service="plumbingtest"} 0' in metrics

            release.set()
            await wait_for(lambda: count(pool, "behind"))

            async def ready() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await wait_for(ready)
            assert f'gpuq_consumer_stalled{{service="plumbingtest",consumer="{durable}"}} 0' in \
                (await client.get("/metrics")).text

            runtime._consumer_tasks[0].cancel()  # the loop ends, as issue 43's did on RecursionError

            async def stopped() -> bool:
                r = await client.get("/readyz")
                detail = r.json()["services"]["plumbingtest"]["checks"]["consumers"]["detail"]
                return r.status_code == 503 and detail == f"{durable}: its loop has stopped"

            await wait_for(stopped)
        finally:
            release.set()
            await runtime.stop()
