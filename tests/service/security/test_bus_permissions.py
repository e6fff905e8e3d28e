"""A leaked service credential reaches only what that service uses, on a real nats-server started with the
generated configuration: telemetry's can neither pull from admission's consumer (draining it), create or take over
one, nor change a stream's limits; every service still starts, consumes and publishes with its own credential.
The streams are bounded: a full stream of facts refuses a publish with a clear error and keeps what it holds."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.js.api import ConsumerConfig, DiscardPolicy, StreamConfig
from nats.js.errors import BadRequestError, ServiceUnavailableError

from services.stack import ALL_SERVICES, Stack, StackSettings
from shared import namespace
from shared.bus import StreamDef, _config, ensure_streams, stream_for_subject, streams
from shared.clock import ScaledClock
from shared.events import JobSubmitted
from shared.natsauth import SERVICES
from tests.service.security.conftest import AuthServer, reset_streams, wait_for
from tests.service.security.test_attacks import CLUSTER, QUEUES, job, publish

JOBS = stream_for_subject(JobSubmitted.subject()).name


async def _refused(errors: list[Exception], subject: str) -> bool:
    for _ in range(50):
        if any("ermissions" in str(e) and subject.lower() in str(e).lower() for e in errors):
            return True
        await asyncio.sleep(0.1)
    return False


async def test_telemetrys_credential_cannot_drain_admissions_consumer_nor_change_a_stream(
        auth_server: AuthServer) -> None:
    await reset_streams(auth_server.admin_url)
    admission, adm_js, adm_errors = await auth_server.connect("admission")
    telemetry, tel_js, errors = await auth_server.connect("telemetry")
    producer, prod_js, _ = await auth_server.connect("producer-team-a")
    try:
        await adm_js.add_consumer(JOBS, ConsumerConfig(durable_name="admission-job", filter_subject=">"))
        await publish(prod_js, JobSubmitted(spec=job("a-1")), JobSubmitted.scoped_subject("team-a"))

        # Pull from admission's consumer: refused, nothing delivered.
        next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{JOBS}.admission-job"
        with pytest.raises(nats.errors.TimeoutError):
            await telemetry.request(next_subject, json.dumps({"batch": 10}).encode(), timeout=1.0)
        assert await _refused(errors, next_subject)
        # Take it over (same durable, another config), or read the stream through a consumer of its own making.
        with pytest.raises(nats.errors.TimeoutError):
            await tel_js.add_consumer(JOBS, ConsumerConfig(durable_name="admission-job", filter_subject=">"),
                                      timeout=1.0)
        with pytest.raises(nats.errors.TimeoutError):
            await tel_js.add_consumer(JOBS, ConsumerConfig(), timeout=1.0)  # an ephemeral one
        assert await _refused(errors, f"$JS.API.CONSUMER.CREATE.{JOBS}")
        # Shrink the stream: no update; a "create" of the existing stream with other limits is refused by the server.
        declared = (await tel_js.stream_info(JOBS)).config
        shrunk = StreamConfig(name=JOBS, subjects=declared.subjects, max_bytes=1024, discard=DiscardPolicy.OLD)
        with pytest.raises(nats.errors.TimeoutError):
            await telemetry.request(f"$JS.API.STREAM.UPDATE.{JOBS}", json.dumps(shrunk.as_dict()).encode(),
                                    timeout=1.0)
        assert await _refused(errors, f"$JS.API.STREAM.UPDATE.{JOBS}")
        with pytest.raises(BadRequestError, match="already in use"):
            await tel_js.add_stream(StreamConfig(name=JOBS, subjects=declared.subjects, max_bytes=1024))
        after = (await adm_js.stream_info(JOBS)).config
        assert (after.max_bytes, after.discard) == (declared.max_bytes, declared.discard)

        # Admission still gets its submission; telemetry still reads through its own consumer.
        sub = await adm_js.pull_subscribe_bind("admission-job", stream=JOBS)
        [msg] = await sub.fetch(1, timeout=5)
        assert json.loads(msg.data)["data"]["spec"]["job_id"] == "a-1"
        await msg.ack_sync()
        await tel_js.add_consumer(JOBS, ConsumerConfig(durable_name="telemetry-job", filter_subject=">"))
        own = await tel_js.pull_subscribe_bind("telemetry-job", stream=JOBS)
        [seen] = await own.fetch(1, timeout=5)
        await seen.ack_sync()
        assert not [e for e in adm_errors if "ermissions" in str(e)]
    finally:
        for nc in (admission, telemetry, producer):
            await nc.close()


@pytest_asyncio.fixture
async def every_service(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]]
                        ) -> AsyncIterator[tuple[Stack, asyncpg.Connection]]:
    """Every service gpuq has, each on its own bus credential, on fresh streams."""
    await reset_streams(auth_server.admin_url)
    database_url = await make_database("buspermissions")
    from shared.servers import free_port

    settings = StackSettings(nats_url=auth_server.admin_url, database_url=database_url, queues=QUEUES,
                             cluster=CLUSTER, services=ALL_SERVICES, clock=ScaledClock(100.0), api_port=free_port(),
                             nats_urls={s: auth_server.url(s) for s in SERVICES})
    async with Stack(settings) as stack:
        conn = await asyncpg.connect(database_url)
        try:
            yield stack, conn
        finally:
            await conn.close()


async def test_every_service_still_works_with_only_its_own_consumers_and_streams(
        auth_server: AuthServer, every_service: tuple[Stack, asyncpg.Connection]) -> None:
    stack, conn = every_service
    assert sorted(r.spec.name for r in stack.runtimes) == sorted(ALL_SERVICES)  # each created its consumers
    nc, js, _ = await auth_server.connect("producer-team-a")
    try:
        await publish(js, JobSubmitted(spec=job("a-works", duration_s=30)), JobSubmitted.scoped_subject("team-a"))
        await wait_for(lambda: conn.fetchval("SELECT outcome = 'Succeeded' FROM admission.jobs "
                                             "WHERE job_id = 'a-works'"), what="the job completed")
        # Those that only read got it too: metering charged it, audit recorded it.
        await wait_for(lambda: conn.fetchval("SELECT count(*) > 0 FROM metering.allocations "
                                             "WHERE job_id = 'a-works'"), what="metering's allocation")
        await wait_for(lambda: conn.fetchval("SELECT count(*) > 0 FROM audit.records WHERE job_id = 'a-works'"),
                       what="the audit records")
        for runtime in stack.runtimes:
            assert runtime.counters.dead_lettered == 0, runtime.spec.name
    finally:
        await nc.close()


async def test_a_full_fact_stream_refuses_new_facts_with_a_clear_error_and_keeps_the_old(
        auth_server: AuthServer) -> None:
    """The declared policy on the server: a small stream built exactly as the platform's are (shared/bus.py)."""
    admin, js, _ = await auth_server.connect("admin")
    ns = namespace.current()
    small = StreamDef(f"{namespace.stream_prefix(ns)}_LIMITTEST", (f"{ns}.limittest.>",), 3600.0, 4096,
                      DiscardPolicy.NEW, "admission")
    await js.add_stream(_config(small, "gpuq:test"))
    try:
        stored = 0
        with pytest.raises(ServiceUnavailableError, match="maximum bytes exceeded"):
            for i in range(100):
                await js.publish(f"{ns}.limittest.x", f"fact {i} ".encode() * 20)
                stored += 1
        assert stored > 0
        state = (await js.stream_info(small.name)).state
        version = admin.connected_server_version
        if (version.major, version.minor) >= (2, 10):
            assert (state.first_seq, state.messages) == (1, stored)  # every fact kept, the oldest too
            assert ((await js.get_msg(small.name, 1)).data or b"").startswith(b"fact 0 ")
        else:  # NATS 2.9 checks the limit on payloads only, then trims to it: a few of the oldest can go
            assert state.messages >= stored * 0.8
    finally:
        await js.delete_stream(small.name)
        await admin.close()


async def test_services_bring_only_their_own_streams_up_to_date(auth_server: AuthServer) -> None:
    """An existing stream declared differently (an older gpuq: unbounded, dropping old facts) is brought to its
    declaration by its owner; another service leaves it, and says so, without failing."""
    await reset_streams(auth_server.admin_url)
    admin, admin_js, _ = await auth_server.connect("admin")
    jobs = next(s for s in streams() if s.name == JOBS)
    old = _config(jobs, "gpuq:test")
    old.max_bytes, old.discard = -1, DiscardPolicy.OLD
    await admin_js.update_stream(old)
    telemetry, tel_js, errors = await auth_server.connect("telemetry")
    admission, adm_js, _ = await auth_server.connect("admission")
    try:
        await ensure_streams(tel_js, purpose="test")  # not its stream to update: left as it is
        assert (await admin_js.stream_info(JOBS)).config.max_bytes == -1
        assert not [e for e in errors if "ermissions" in str(e)]  # it did not even try
        await ensure_streams(adm_js, purpose="test")  # the owner's
        info = (await admin_js.stream_info(JOBS)).config
        assert (info.max_bytes, info.discard, info.description) == (jobs.max_bytes, DiscardPolicy.NEW, "gpuq:test")
    finally:
        for nc in (admin, telemetry, admission):
            await nc.close()
