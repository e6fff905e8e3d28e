"""Hops per preemption over the real bus (issue 50: "fewer hops per reclaim: state how many remain and why").

Four stories on one cohort of two teams and one 8-GPU node, each printing its chain (`pytest -s`):
- priority: team A's low job runs on the node; team A's normal job, admitted by borrowing team B's idle quota,
  cannot be placed, so the scheduler asks for a preemption (no JobAdmitted after it: the preemptor is admitted);
- reclaim: team A's low job borrows team B's quota; team B's high job reclaims it (admission asks, and admits its
  job once the preemption released the quota: a JobAdmitted after JobPreempted);
each with a victim that checkpoints first (CheckpointRequested, JobCheckpointed) and one that cannot.
docs/preemption.md ("Hops per preemption") says why each remaining hop is kept."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import nats
import pytest

from services.api.readmodel import fetch_status
from services.core.preemption import preemption_chains
from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.config import parse_cluster, parse_queues
from shared.domain import CheckpointSpec, JobSpec, PodSet
from shared.events import JobSubmitted, make_event
from shared.namespace import subject as ns_subject
from shared.service import publish_event
from tests.system.reclaim_story import wait_until

CLUSTER = parse_cluster({"node_groups": [
    {"name": "h100", "count": 1, "gpus_per_node": 8, "gpu_model": "H100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576},
]})
QUEUES = parse_queues({
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "normal", "value": 100, "preemptible": True},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [
        {"name": "team-a", "cohort": "research", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 4}}},
        {"name": "team-b", "cohort": "research", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 8}}},
    ],
    "policy": {"protection_window_s": 60, "checkpoint_grace_s": 300},
})
KINDS = ("preemption.requested", "job.checkpoint_requested", "job.checkpointed", "job.preempted", "job.admitted",
         "job.placed")
CHECKPOINT = ("job.checkpoint_requested", "job.checkpointed")


def job(job_id: str, team: str, klass: str, gpus: int, *, checkpoint: bool = False) -> JobSpec:
    return JobSpec(job_id=job_id, team=team, queue=team, priority_class=klass,
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus),), checkpoint=CheckpointSpec(supported=checkpoint),
                   max_runtime_s=20_000, labels={"sim.gpuq.io/duration-s": "300"})


async def _events(nats_url: str) -> list[dict[str, Any]]:
    nc = await nats.connect(nats_url)
    out = []
    for kind in KINDS:
        sub = await nc.jetstream().subscribe(ns_subject(kind), ordered_consumer=True)
        while True:
            try:
                out.append(json.loads((await sub.next_msg(timeout=0.5)).data))
            except TimeoutError:
                break
    await nc.close()
    return out


@pytest.mark.parametrize("story,checkpoint", [("priority", True), ("priority", False), ("reclaim", True),
                                              ("reclaim", False)])
async def test_hops_per_preemption(story: str, checkpoint: bool, fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    clock = ScaledClock(100.0)
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("admission", "scheduler", "preemption", "executor"), clock=clock)
    # priority: a-low holds team A's 4 and the node's other 4 (borrowed from team B); a-normal borrows too.
    # reclaim: a-low borrows 4 of team B's 8; b-high wants all 8 back.
    victim = job("a-low", "team-a", "low", 8, checkpoint=checkpoint)
    preemptor = job("a-normal", "team-a", "normal", 4) if story == "priority" else job("b-high", "team-b", "high", 8)
    async with Stack(settings):
        nc = await nats.connect(nats_url)
        js = nc.jetstream()

        async def submit(spec: JobSpec) -> None:
            now = datetime.fromtimestamp(clock.now(), UTC)
            await publish_event(js, make_event(JobSubmitted(spec=spec, submitted_at=now), source="test", time=now),
                                JobSubmitted.scoped_subject(spec.team))

        async def is_(job_id: str, wanted: str) -> bool:
            rows = await fetch_status(database_url, job_id)
            return (rows[0]["state"] if rows else "unknown") == wanted

        await submit(victim)
        await wait_until(lambda: is_("a-low", "running"))
        await asyncio.sleep(1.0)  # 100 virtual seconds: past the 60 s protection window
        await submit(preemptor)
        await wait_until(lambda: is_(preemptor.job_id, "running"))
        await nc.close()
    (chain,) = preemption_chains(await _events(nats_url))
    print(f"\n{story}, {'checkpoint' if checkpoint else 'no checkpoint'}: hops per preemption {chain.hops} "
          f"({' -> '.join(chain.steps)})")
    assert (chain.victim, chain.preemptor) == ("a-low", preemptor.job_id)
    expected = ("preemption.requested", *(CHECKPOINT if checkpoint else ()), "job.preempted",
                *(("job.admitted",) if story == "reclaim" else ()), "job.placed")
    assert chain.steps == expected
