"""The executor's fence: an instance whose lease term was superseded (another took over while it was not looking)
acts no more. A placement it is handed is refused before its handler runs, its run loop ends no run, and the
runtime pauses it and takes the lease again, with a new term, before it acts again."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg
import pytest

from services.stack import Stack, StackSettings
from shared.config import parse_cluster, parse_queues
from shared.domain import GpuBinding, JobSpec, PodSet
from shared.events import JobPlaced, encode_event, make_event
from shared.leader import LostLeadership

CLUSTER = parse_cluster({"node_groups": [
    {"name": "h100", "count": 1, "gpus_per_node": 8, "gpu_model": "H100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576},
]})
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 8}}}],
})


@pytest.mark.timeout(120)
async def test_a_superseded_executor_acts_no_more_and_leads_again_with_a_new_term(
        fresh: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    nats_url, database_url = fresh
    monkeypatch.setenv("GPUQ_LEASE_TTL_S", "5")
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("executor",))
    async with Stack(settings) as stack:
        runtime = stack.runtime("executor")
        assert runtime.lease is not None and runtime.phase == "running"
        term = runtime.lease.term
        conn = await asyncpg.connect(database_url)
        try:
            # Another instance took the lease over meanwhile: the term moved on.
            await conn.execute("UPDATE executor.leader_terms SET term = term + 1 WHERE scope = 'executor'")
            spec = JobSpec(job_id="fenced", team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=1),))
            placed = JobPlaced(job_id="fenced", spec=spec, bindings=(GpuBinding(pod="main-0", node="h100-0",
                                                                                gpu_indices=(0,)),),
                               placed_at=datetime.now(UTC))
            body = encode_event(make_event(placed, source="test", time=datetime.now(UTC)))
            with pytest.raises(LostLeadership):
                await runtime.handle(body, subject=placed.subject())
            assert await conn.fetchval("SELECT count(*) FROM executor.runs") == 0
            assert await conn.fetchval("SELECT count(*) FROM executor.inbox") == 0  # rolled back: handled later

            # Its run loop meets the fence too: the runtime pauses it and campaigns; it leads again, a new term.
            deadline = asyncio.get_running_loop().time() + 60
            while not (runtime.recoveries >= 1 and runtime.phase == "running"):
                assert asyncio.get_running_loop().time() < deadline, f"still {runtime.phase}"
                await asyncio.sleep(0.2)
            assert runtime.lease.term is not None and term is not None and runtime.lease.term > term + 1
        finally:
            await conn.close()
