"""Node failure in the running services: a NodeChanged that fails a node reaches its owner, the scheduler (and
telemetry's gauges), and the others see it in the scheduler's read model; the scheduler stops placing on it until
it is back, and the job the executor requeued from it (JobPreempted, NodeFailure) is
placed again elsewhere, resuming from its checkpoint. (The executor's side, from the node informer, is tested
against the fake API server in tests/system/test_kube_*.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import nats

from services.scheduler import readmodel
from services.stack import Stack, StackSettings
from shared.clock import ManualClock
from shared.config import parse_cluster, parse_queues
from shared.domain import CheckpointSpec, JobSpec, NodeHealth, PodSet
from shared.events import (
    JobPreempted,
    JobSubmitted,
    NodeChanged,
    NodeInventory,
    Payload,
    PreemptionReason,
    make_event,
)
from shared.service import default_subject, publish_event

NODES = {n.name: n for n in parse_cluster({"node_groups": [
    {"name": "gpu", "count": 2, "gpus_per_node": 8, "gpu_model": "H100", "cpu_milli": 64000, "memory_mib": 512000,
     "nodes_per_rack": 2}]}).nodes()}
QUEUES = parse_queues({"priority_classes": [{"name": "normal", "value": 100}],
                       "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100": {"nominal": 16}}}]})
T0 = datetime(2026, 11, 30, tzinfo=UTC)


def job(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=8),),
                   checkpoint=CheckpointSpec(supported=True), max_runtime_s=3600)


async def wait_for(check: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_failed_node_is_avoided_until_back_and_its_job_runs_elsewhere(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES,
                             services=("admission", "scheduler", "preemption", "metering", "telemetry"),
                             clock=ManualClock(T0.timestamp()))
    async with Stack(settings):
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        conn = await asyncpg.connect(database_url)

        async def send(payload: Payload) -> str:
            event = make_event(payload, source="gpuq/executor/test", time=T0)
            await publish_event(js, event, default_subject(payload))
            return event.id

        async def placements(job_id: str) -> list[str]:
            rows = await conn.fetch("SELECT bindings FROM scheduler.jobs WHERE job_id = $1 AND status = 'placed'",
                                    job_id)
            return [b["node"] for r in rows for b in json.loads(r["bindings"])]

        await send(NodeInventory(nodes=tuple(NODES.values()), source="kubernetes"))
        await send(JobSubmitted(spec=job("a"), submitted_at=T0))
        await wait_for(lambda: _nonempty(placements("a")))
        (first_node,) = await placements("a")
        other = next(name for name in NODES if name != first_node)

        failed = NODES[first_node].model_copy(update={"health": NodeHealth.FAILED})
        changed_id = await send(NodeChanged(node=failed, change="updated"))
        for schema in ("scheduler", "telemetry"):
            await wait_for(lambda s=schema: _handled(conn, s, changed_id))
        # The scheduler owns the fact; the others read it from its read model and keep no copy.
        facts = {f.name: f for f in await readmodel.node_facts(conn)}
        assert facts[first_node].spec.health is NodeHealth.FAILED
        for schema in ("admission", "preemption", "metering", "telemetry"):
            assert await conn.fetchval("SELECT to_regclass($1)", f"{schema}.nodes") is None, schema
        for schema in ("admission", "preemption", "metering"):
            assert not await _handled(conn, schema, changed_id), schema

        # The executor requeues the job that ran there, from its checkpoint: it is placed on the other node.
        await send(JobPreempted(job_id="a", reason=PreemptionReason.NODE_FAILURE, checkpoint_uri="s3://ckpt/a/7",
                                preempted_at=T0))
        await wait_for(lambda: _equals(placements("a"), [other]))
        resume = await conn.fetchval("SELECT resume_from FROM scheduler.jobs WHERE job_id = 'a'")
        assert resume == "s3://ckpt/a/7"

        # Nothing else may use the failed node: a second job waits, with the reason...
        await send(JobSubmitted(spec=job("b"), submitted_at=T0))
        await wait_for(lambda: _scalar(conn, "SELECT coalesce(s.reason, a.reason) FROM admission.jobs a LEFT JOIN "
                                             "scheduler.jobs s USING (job_id) WHERE job_id = 'b'"))
        assert await placements("b") == []
        # ...until the node is back.
        await send(NodeChanged(node=NODES[first_node], change="updated"))
        await wait_for(lambda: _equals(placements("b"), [first_node]))
        await conn.close()
        await nc.close()


async def _handled(conn: asyncpg.Connection, schema: str, event_id: str) -> bool:
    return bool(await conn.fetchval(f"SELECT count(*) FROM {schema}.inbox WHERE event_id LIKE $1 || '%'", event_id))


async def _nonempty(value: Awaitable[Any]) -> bool:
    return bool(await value)


async def _equals(value: Awaitable[Any], expected: Any) -> bool:
    return (await value) == expected


async def _scalar(conn: asyncpg.Connection, sql: str) -> bool:
    return (await conn.fetchval(sql)) is not None
