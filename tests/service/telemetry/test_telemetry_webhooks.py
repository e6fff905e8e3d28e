"""Webhook delivery against a real HTTP receiver on 127.0.0.1 that verifies Standard Webhooks signatures
with the reference `standardwebhooks` package: retries with backoff, dead letters, SSRF refusals."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import asyncpg
import pytest

from services.telemetry.app import TelemetryService
from services.telemetry.webhooks import store
from services.telemetry.webhooks.backoff import RetryPolicy
from services.telemetry.webhooks.delivery import DeliveryWorker
from services.telemetry.webhooks.signing import CONTENT_TYPE
from services.telemetry.webhooks.ssrf import AllowList
from shared.clock import ManualClock
from shared.events import JobCompleted, JobSubmitted, Payload, make_event, parse_event, utcnow_from
from shared.service import Tx
from tests.service.telemetry.telemetry_receiver import LOOPBACK, Receiver
from tests.unit.telemetry.telemetry_builders import T0, spec

pytestmark = pytest.mark.asyncio(loop_scope="session")
@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        r.close()


async def handle(svc: TelemetryService, pool: asyncpg.Pool, payload: Payload, t: float, event=None,  # type: ignore[no-untyped-def]
                 subject: str | None = None):
    """Hand the event over as the runtime does: with the subject it came on (a submission: its spec's team's, unless
    `subject` says otherwise)."""
    event = event or make_event(payload, source="test", time=utcnow_from(T0 + t))
    if subject is None:
        subject = payload.scoped_subject(payload.spec.team) if isinstance(payload, JobSubmitted) else ""
    async with pool.acquire() as conn, conn.transaction():
        await svc.on_event(Tx(conn=conn, now=T0 + t, source="test", schema="telemetry", subject=subject), event,
                           payload)
    return event


async def subscribe(pool: asyncpg.Pool, r: Receiver, team: str | None = "team-a",
                    events: tuple[str, ...] = ("job.completed",)) -> store.Subscription:
    async with pool.acquire() as conn:
        sub = await store.add_subscription(conn, r.url, team, list(events))
    r.secret = sub.secret
    return sub


async def completed_job(svc: TelemetryService, pool: asyncpg.Pool, job_id: str, team: str, t: float):  # type: ignore[no-untyped-def]
    await handle(svc, pool, JobSubmitted(spec=spec(job_id, team=team)), t)
    return await handle(svc, pool, JobCompleted(job_id=job_id, finished_at=utcnow_from(T0 + t + 60)), t + 60)


def worker(pool: asyncpg.Pool, clock: ManualClock, allow: AllowList, attempts: int) -> DeliveryWorker:
    return DeliveryWorker(pool, clock, allow=allow, rng=random.Random(7), timeout_s=5,
                          policy=RetryPolicy(max_attempts=attempts, base_s=10, factor=3, jitter=0.25))


async def delivery_row(pool: asyncpg.Pool, event_id: str) -> asyncpg.Record:
    return await pool.fetchrow("SELECT * FROM telemetry.webhook_deliveries WHERE event_id = $1", event_id)


async def test_receiver_fails_twice_then_gets_it_with_the_same_id(pool: asyncpg.Pool, receivers: list) -> None:
    svc = TelemetryService(metrics_port=None, webhook_worker=False)
    r = Receiver([500, 503])
    receivers.append(r)
    await subscribe(pool, r)
    event = await completed_job(svc, pool, "job-1", "team-a", 0)
    await completed_job(svc, pool, "other", "team-b", 0)  # another team: not delivered
    await handle(svc, pool, JobCompleted(job_id="job-1", finished_at=utcnow_from(T0)), 61, event)  # redelivery
    clock = ManualClock(T0 + 60)
    w = worker(pool, clock, LOOPBACK, attempts=5)

    assert await w.run_once() == 1
    assert await w.run_once() == 0  # backed off: not due yet
    clock.advance(10 * 1.25 + 0.1)
    assert await w.run_once() == 1
    clock.advance(30 * 1.25 + 0.1)
    assert await w.run_once() == 1
    clock.advance(3600)
    assert await w.run_once() == 0

    assert len(r.requests) == 3
    assert {h["webhook-id"] for h, _, _ in r.requests} == {event.id}
    assert all(ok for _, _, ok in r.requests), "every attempt carries a valid signature"
    headers, body, _ = r.requests[-1]
    assert headers["content-type"] == CONTENT_TYPE
    received, payload = parse_event(body)
    assert received.id == event.id and received.type == "io.gpuq.job.completed.v1"
    assert isinstance(payload, JobCompleted) and payload.job_id == "job-1"
    row = await delivery_row(pool, event.id)
    assert (row["status"], row["attempts"], row["last_status"]) == ("delivered", 3, 200)
    svc.metrics.shutdown()


async def test_dead_letter_after_the_last_try(pool: asyncpg.Pool, receivers: list) -> None:
    svc = TelemetryService(metrics_port=None, webhook_worker=False)
    r = Receiver([500] * 10)
    receivers.append(r)
    sub = await subscribe(pool, r, team=None, events=("*",))
    event = await completed_job(svc, pool, "job-2", "team-c", 0)
    clock = ManualClock(T0 + 60)
    w = worker(pool, clock, LOOPBACK, attempts=3)
    for _ in range(6):
        await w.run_once()
        clock.advance(3600)
    # Subscribed to everything: JobSubmitted and JobCompleted were both queued; each tried 3 times.
    assert len(r.requests) == 6
    row = await delivery_row(pool, event.id)
    assert (row["status"], row["attempts"]) == ("dead", 3)
    dead = await pool.fetchrow("SELECT * FROM telemetry.webhook_dead_letters WHERE event_id = $1", event.id)
    assert (dead["subscription_id"], dead["attempts"], dead["last_error"], dead["last_status"]) == \
        (sub.id, 3, "HTTP 500", 500)
    svc.metrics.shutdown()


async def test_loopback_refused_without_allow_list_and_rechecked_on_every_retry(
        pool: asyncpg.Pool, receivers: list) -> None:
    svc = TelemetryService(metrics_port=None, webhook_worker=False)
    r = Receiver([500])
    receivers.append(r)
    await subscribe(pool, r)
    event = await completed_job(svc, pool, "job-3", "team-a", 0)
    clock = ManualClock(T0 + 60)
    w = worker(pool, clock, LOOPBACK, attempts=3)
    await w.run_once()  # allowed: reaches the receiver, which fails
    assert len(r.requests) == 1
    w.allow = AllowList()  # the allow-list no longer covers loopback: the retry must be refused
    for _ in range(3):
        clock.advance(3600)
        await w.run_once()
    assert len(r.requests) == 1
    row = await delivery_row(pool, event.id)
    assert row["status"] == "dead"
    assert row["last_error"].startswith("refused:") and "loopback" in row["last_error"]
    svc.metrics.shutdown()


async def test_a_rebinding_name_answering_an_ipv6_form_of_loopback_is_refused_at_delivery(
        pool: asyncpg.Pool) -> None:
    """At delivery the target's name is resolved again; an answer that hides 127.0.0.1 in an IPv6 form
    (IPv4-compatible, IPv4-translated, Teredo) is refused like 127.0.0.1 itself, and nothing is sent."""
    svc = TelemetryService(metrics_port=None, webhook_worker=False)
    async with pool.acquire() as conn:
        await store.add_subscription(conn, "http://hooks.example.test:9/hook", "team-v6", ["job.completed"])
    event = await completed_job(svc, pool, "job-v6", "team-v6", 0)
    clock = ManualClock(T0 + 60)
    w = worker(pool, clock, AllowList(), attempts=3)
    answers = iter(["::7f00:1", "::ffff:0:7f00:1", "2001:0:4136:e378:8000:63bf:80ff:fffe"])

    async def rebinding(host: str, port: int) -> list[str]:
        return [next(answers)]

    w.resolver = rebinding
    for _ in range(3):
        await w.run_once()
        clock.advance(3600)
    row = await delivery_row(pool, event.id)
    assert (row["status"], row["attempts"]) == ("dead", 3)
    assert row["last_error"].startswith("refused:") and "(loopback)" in row["last_error"]
    svc.metrics.shutdown()


async def test_redirects_are_not_followed(pool: asyncpg.Pool, receivers: list) -> None:
    svc = TelemetryService(metrics_port=None, webhook_worker=False)
    elsewhere = Receiver([])
    r = Receiver([302], redirect_to=elsewhere.url)
    receivers.extend([r, elsewhere])
    await subscribe(pool, r)
    event = await completed_job(svc, pool, "job-4", "team-a", 0)
    w = worker(pool, ManualClock(T0 + 60), LOOPBACK, attempts=3)
    await w.run_once()
    assert len(r.requests) == 1 and elsewhere.requests == []
    row = await delivery_row(pool, event.id)
    assert (row["status"], row["last_status"], row["last_error"]) == ("pending", 302, "HTTP 302")
    svc.metrics.shutdown()


async def test_subscription_crud_and_event_validation(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        a = await store.add_subscription(conn, "https://example.com/a", "team-a", ["job.preempted", "job.completed"])
        await store.add_subscription(conn, "https://example.com/b", None, ["*"])
        assert a.secret.startswith("whsec_") and a.events == ("job.completed", "job.preempted")
        assert [s.id for s in await store.list_subscriptions(conn, "team-a")] == [a.id]
        assert len(await store.list_subscriptions(conn)) == 2
        assert await store.remove_subscription(conn, a.id)
        assert not await store.remove_subscription(conn, a.id)
        with pytest.raises(ValueError, match="unknown event"):
            await store.add_subscription(conn, "https://example.com/c", "t", ["job.exploded"])
    assert json.loads(json.dumps(store.WEBHOOK_EVENTS))


async def test_a_410_disables_the_subscription_and_nothing_is_lost(pool: asyncpg.Pool, receivers: list) -> None:
    svc = TelemetryService(metrics_port=None, webhook_worker=False)
    r = Receiver([410])
    receivers.append(r)
    sub = await subscribe(pool, r)
    first = await completed_job(svc, pool, "gone-1", "team-a", 0)
    clock = ManualClock(T0 + 60)
    w = worker(pool, clock, LOOPBACK, attempts=5)
    assert await w.run_once() == 1
    async with pool.acquire() as conn:
        (stored,) = await store.list_subscriptions(conn, "team-a")
    assert not stored.active and stored.disabled_reason and "410" in stored.disabled_reason
    later = await completed_job(svc, pool, "gone-2", "team-a", 100)  # not queued for a disabled subscription
    for _ in range(3):
        clock.advance(3600)
        assert await w.run_once() == 0
    assert len(r.requests) == 1
    assert await delivery_row(pool, later.id) is None
    row = await delivery_row(pool, first.id)
    assert (row["status"], row["last_status"]) == ("pending", 410)  # waiting, not dropped
    async with pool.acquire() as conn:
        assert await store.enable_subscription(conn, sub.id)
    assert await w.run_once() == 1
    assert (await delivery_row(pool, first.id))["status"] == "delivered"
    assert [h["webhook-id"] for h, _, ok in r.requests if ok] == [first.id, first.id]
    svc.metrics.shutdown()


async def test_throttling_honours_retry_after_for_the_whole_subscription(pool: asyncpg.Pool,
                                                                         receivers: list) -> None:
    svc = TelemetryService(metrics_port=None, webhook_worker=False)
    r = Receiver([(429, {"retry-after": "120"}), (502, {}), (504, {})])
    receivers.append(r)
    await subscribe(pool, r)
    first = await completed_job(svc, pool, "busy-1", "team-a", 0)
    second = await completed_job(svc, pool, "busy-2", "team-a", 0)
    clock = ManualClock(T0 + 60)
    w = worker(pool, clock, LOOPBACK, attempts=8)  # backoff alone would retry after 7.5-12.5 s
    await w.run_once()
    assert len(r.requests) == 1, "the second delivery is held back with the first: the receiver asked to slow down"
    for d in (first, second):
        row = await delivery_row(pool, d.id)
        assert row["next_attempt_at"].timestamp() >= T0 + 60 + 120
    assert (await delivery_row(pool, second.id))["attempts"] == 0, "an untried delivery used no attempt"
    clock.advance(100)
    assert await w.run_once() == 0  # Retry-After not reached, though the backoff's 12.5 s are
    clock.advance(21)
    await w.run_once()  # 502 on the first: throttled again (backoff), the second held back
    assert len(r.requests) == 2
    clock.advance(3600)
    await w.run_once()  # 504, then the second is held back again
    clock.advance(3600)
    await w.run_once()
    clock.advance(3600)
    await w.run_once()
    assert {(await delivery_row(pool, d.id))["status"] for d in (first, second)} == {"delivered"}
    assert [h["webhook-id"] for h, _, _ in r.requests] == [first.id] * 4 + [second.id]
    svc.metrics.shutdown()


async def test_rotation_sends_two_signatures_until_the_old_secret_expires(pool: asyncpg.Pool,
                                                                          receivers: list) -> None:
    svc = TelemetryService(metrics_port=None, webhook_worker=False)
    old_receiver, new_receiver = Receiver([]), Receiver([])
    receivers.extend([old_receiver, new_receiver])
    clock = ManualClock(T0 + 60)
    async with pool.acquire() as conn:
        old = await store.add_subscription(conn, old_receiver.url, "team-a", ["job.completed"])
        await store.add_subscription(conn, new_receiver.url, "team-a", ["job.completed"], secret=old.secret)
        # Both receivers rotate: one keeps verifying with the old secret, the other switches at once.
        rotated = [await store.rotate_secret(conn, s.id, clock.now(), grace_s=3600)
                   for s in await store.list_subscriptions(conn, "team-a")]
    new_receiver.secret = next(s.secret for s in rotated if s is not None and s.url == new_receiver.url)
    old_receiver.secret = old.secret
    assert new_receiver.secret != old.secret
    during = await completed_job(svc, pool, "rot-1", "team-a", 0)
    w = worker(pool, clock, LOOPBACK, attempts=3)
    await w.run_once()
    for receiver in (old_receiver, new_receiver):
        headers, _, verified = receiver.requests[-1]
        assert verified and headers["webhook-id"] == during.id
        assert len(headers["webhook-signature"].split(" ")) == 2
    clock.advance(3601)  # the grace period is over: only the new secret signs
    after = await completed_job(svc, pool, "rot-2", "team-a", 3600)  # completed at T0 + 3660, due now
    assert await w.run_once() == 2
    assert old_receiver.requests[-1][0]["webhook-id"] == after.id
    assert old_receiver.requests[-1][2] is False and new_receiver.requests[-1][2] is True
    assert len(new_receiver.requests[-1][0]["webhook-signature"].split(" ")) == 1
    svc.metrics.shutdown()
