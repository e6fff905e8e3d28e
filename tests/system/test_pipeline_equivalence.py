"""The services and the simulator run one pipeline: the same small trace through the real services (NATS,
Postgres, the simulated executor on an accelerated clock) and through the simulator's `gpuq` policy gives the
same placements (job -> nodes and GPUs) and the same start order. This is what lets the benchmarks speak for
production.

The trace exercises a gang kept in one rack, borrowing (team-b runs above its nominal quota on team-a's idle
quota), a reservation for a gang that does not fit yet, a backfill that ends before it, and a higher-priority
job admitted later that takes the reservation (the placement order the pipeline owns; no preemption runs
here: the simulator's policy has none and the stack no preemption service). Submissions are
spaced far enough apart on the accelerated clock that each one's cascade of events settles before the next
(the services decide on events, the simulator at instants: only their decisions are compared, not times).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import asyncpg
import nats

from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.config import parse_cluster, parse_queues
from shared.domain import TopologyLevel
from shared.events import JobSubmitted, make_event
from shared.service import publish_event
from sim.engine import CycleOutput, Engine
from sim.model import Trace, TraceJob
from sim.policies.gpuq import GpuqPolicy

SPEED = 60.0  # virtual seconds per wall second
CLUSTER = parse_cluster({"node_groups": [
    {"name": "h100", "count": 4, "gpus_per_node": 8, "gpu_model": "H100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576, "nodes_per_rack": 2},
]})
QUEUES = parse_queues({
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "normal", "value": 100, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [
        {"name": "team-a", "cohort": "research", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 16}}},
        {"name": "team-b", "cohort": "research", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 16}}},
    ],
})


def tj(job_id: str, team: str, submit: int, pods: int, gpus: int, duration: int, estimate: int,
       priority: str = "normal") -> TraceJob:
    return TraceJob(job_id=job_id, submit_time=submit, duration=duration, team=team, queue=team, pods=pods,
                    gpus_per_pod=gpus, gpu_models=("H100-80GB",), max_runtime_s=estimate, priority_class=priority,
                    preferred_level=TopologyLevel.RACK if pods > 1 else None)


TRACE = [
    tj("b1-gang", "team-b", 0, pods=2, gpus=8, duration=2000, estimate=2100),  # one rack
    tj("b2-borrow", "team-b", 300, pods=1, gpus=8, duration=1000, estimate=1100),  # beyond b's nominal 16
    tj("a1", "team-a", 600, pods=1, gpus=4, duration=3000, estimate=3100),
    tj("a2-reserved", "team-a", 900, pods=2, gpus=4, duration=500, estimate=600),  # waits for b2's GPUs
    tj("a3-backfill", "team-a", 1000, pods=1, gpus=4, duration=100, estimate=200),  # ends before a2's slot
    # Admitted after a2 but placed before it: the pipeline places by priority, then admission time.
    tj("a4-high", "team-a", 1200, pods=2, gpus=4, duration=300, estimate=400, priority="high"),
]
def simulated() -> tuple[list[str], dict[str, list[tuple[str, tuple[int, ...]]]]]:
    """Start order and placements from the simulator's `gpuq` policy (no preemption needed by this trace)."""
    trace = Trace(name="equivalence", jobs=sorted(TRACE, key=lambda j: (j.submit_time, j.job_id)),
                  nodes=CLUSTER.nodes(), queues=QUEUES)
    order: list[str] = []
    placements: dict[str, list[tuple[str, tuple[int, ...]]]] = {}

    class Recording(GpuqPolicy):
        def cycle(self, now: float) -> CycleOutput:
            out = super().cycle(now)
            for job_id in out.started:
                order.append(job_id)
                p = self.cluster.placement_of(job_id)
                assert p is not None
                placements[job_id] = sorted((b.node, b.gpu_indices) for b in p.bindings)
            return out

    policy = Recording()
    Engine(trace, policy).run()
    return order, placements


async def test_the_services_and_the_simulator_place_the_same_jobs_on_the_same_gpus_in_the_same_order(
        fresh: tuple[str, str]) -> None:
    sim_order, sim_placements = simulated()
    # The trace does what it says: the backfill starts before the reserved gang, the high job overtakes it.
    assert sim_order == ["b1-gang", "b2-borrow", "a1", "a3-backfill", "a4-high", "a2-reserved"]

    nats_url, database_url = fresh
    clock = ScaledClock(SPEED)
    origin = clock.now()
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("admission", "scheduler", "executor"), clock=clock)
    async with Stack(settings):
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        conn = await asyncpg.connect(database_url)
        try:
            for job in sorted(TRACE, key=lambda j: (j.submit_time, j.job_id)):
                await asyncio.sleep(max(0.0, (origin + job.submit_time - clock.now()) / SPEED))
                # The same spec the simulator builds; only the simulated executor reads the true duration.
                spec = job.spec().model_copy(update={"labels": {"sim.gpuq.io/duration-s": str(job.duration)}})
                at = datetime.fromtimestamp(clock.now(), UTC)
                await publish_event(js, make_event(JobSubmitted(spec=spec, submitted_at=at), source="test", time=at),
                                    JobSubmitted.scoped_subject(spec.team))
            deadline = asyncio.get_running_loop().time() + 60
            while await conn.fetchval("SELECT count(*) FROM scheduler.jobs WHERE placed_at IS NOT NULL") < len(TRACE):
                assert asyncio.get_running_loop().time() < deadline, "not every job was placed"
                await asyncio.sleep(0.2)
            rows = await conn.fetch("SELECT job_id, bindings FROM scheduler.jobs ORDER BY placed_at, job_id")
        finally:
            await conn.close()
            await nc.close()
    prod_order = [r["job_id"] for r in rows]
    prod_placements = {r["job_id"]: sorted((b["node"], tuple(b["gpu_indices"])) for b in json.loads(r["bindings"]))
                       for r in rows}
    assert prod_order == sim_order
    assert prod_placements == sim_placements
