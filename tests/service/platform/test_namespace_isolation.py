"""A platform namespace is never touched by a test session or a demo beside it on the same servers.

The bystander here stands for a real platform: streams created by `gpuq up` (marked `gpuq:platform`) holding
events nobody has consumed yet. A whole job's life runs in the session's namespace, the session resets its bus
as every test does, and the demo is asked to reset the bystander: afterwards the bystander's streams hold the
same messages and no consumer was created on them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import nats
import pytest
import pytest_asyncio
from nats.js import JetStreamContext

from cli.platform import DemoRefused, _demo_on_own_resources
from services.stack import Stack, StackSettings
from shared import namespace
from shared.bus import NamespaceInUse, delete_streams, ensure_streams, namespace_purposes, streams
from shared.clock import ScaledClock
from shared.config import parse_cluster, parse_queues
from shared.domain import JobSpec, PodSet
from shared.events import JobSubmitted, encode_event, make_event
from shared.service import publish_event

CLUSTER = parse_cluster({"node_groups": [
    {"name": "a100", "count": 2, "gpus_per_node": 8, "gpu_model": "A100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576, "nodes_per_rack": 2},
]})
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"A100-80GB": {"nominal": 16}}}],
})
T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def submitted(job_id: str) -> JobSubmitted:
    return JobSubmitted(spec=JobSpec(job_id=job_id, team="team-a", queue="team-a",
                                     pod_sets=(PodSet(count=1, gpus_per_pod=8),), max_runtime_s=600,
                                     labels={"sim.gpuq.io/duration-s": "60"}), submitted_at=T0)


async def stream_state(js: JetStreamContext, ns: str) -> dict[str, tuple[int, int, int]]:
    """{stream: (messages, last sequence, consumers)}."""
    out = {}
    for stream in streams(ns):
        info = await js.stream_info(stream.name)
        out[stream.name] = (info.state.messages, info.state.last_seq, info.state.consumer_count)
    return out


@pytest_asyncio.fixture
async def bystander(nats_url: str) -> AsyncIterator[tuple[JetStreamContext, str]]:
    """A platform in its own namespace with three unconsumed submissions (the test created it, so it removes it)."""
    ns = namespace.fresh("bystander")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js, ns, purpose="platform")
    for i in range(3):
        event = make_event(submitted(f"theirs-{i}"), source="their-pipeline", time=T0)
        await js.publish(f"{ns}.job.submitted.team-a", encode_event(event), headers={"Nats-Msg-Id": event.id})
    try:
        yield js, ns
    finally:
        await delete_streams(js, ns, purpose="platform")
        await nc.close()


async def test_a_session_beside_a_platform_leaves_its_streams_and_messages_untouched(
        fresh: tuple[str, str], bystander: tuple[JetStreamContext, str]) -> None:
    nats_url, database_url = fresh
    js, theirs = bystander
    before = await stream_state(js, theirs)
    assert before[f"{namespace.stream_prefix(theirs)}_JOBS"][0] == 3

    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("admission", "scheduler", "executor"), clock=ScaledClock(100.0))
    async with Stack(settings) as stack:
        nc = await nats.connect(nats_url)
        await publish_event(nc.jetstream(), make_event(submitted("ours-1"), source="test", time=T0),
                            JobSubmitted.scoped_subject("team-a"))
        await nc.close()
        async with stack.pool.acquire() as conn:  # type: ignore[union-attr]
            for _ in range(300):
                if await conn.fetchval("SELECT status FROM executor.runs WHERE job_id = 'ours-1'") == "completed":
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("our job did not complete in the session's namespace")
            # The bystander's submissions never reached our admission.
            assert await conn.fetchval("SELECT count(*) FROM admission.jobs WHERE job_id LIKE 'theirs-%'") == 0
    # What every test does between tests (tests/conftest.py reset_bus): reset the session's own namespace.
    await delete_streams(js, namespace.current(), purpose="test")
    await ensure_streams(js, namespace.current(), purpose="test")

    assert await stream_state(js, theirs) == before  # same messages, no consumer created on them
    assert set((await namespace_purposes(js, theirs)).values()) == {"platform"}


async def test_deleting_or_demo_resetting_a_platform_namespace_is_refused(
        nats_url: str, database_url: str, bystander: tuple[JetStreamContext, str]) -> None:
    js, theirs = bystander
    before = await stream_state(js, theirs)
    with pytest.raises(NamespaceInUse, match=r"not created by a gpuq test.*\(platform\)"):
        await delete_streams(js, theirs, purpose="test")
    with pytest.raises(DemoRefused, match="not created by a gpuq demo"):
        await _demo_on_own_resources(nats_url, database_url, theirs, True, False, CLUSTER, QUEUES, [], 100.0, 1.0)
    with pytest.raises(DemoRefused, match=r"already has streams .* pass --reset"):
        await _demo_on_own_resources(nats_url, database_url, theirs, False, False, CLUSTER, QUEUES, [], 100.0, 1.0)
    assert await stream_state(js, theirs) == before


async def test_streams_created_by_hand_count_as_a_platform(nats_url: str) -> None:
    """A stream without gpuq's marker (an operator's, or an older gpuq's) is never deleted by a reset."""
    ns = namespace.fresh("handmade")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    jobs = streams(ns)[0]
    await js.add_stream(name=jobs.name, subjects=list(jobs.subjects))
    try:
        assert await namespace_purposes(js, ns) == {jobs.name: None}
        with pytest.raises(NamespaceInUse, match="unmarked: a platform"):
            await delete_streams(js, ns, purpose="demo")
        assert (await js.stream_info(jobs.name)).config.name == jobs.name
    finally:
        await js.delete_stream(jobs.name)  # created by this test
        await nc.close()
