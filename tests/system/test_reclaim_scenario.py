"""The seed's story, over the real bus: team A borrows team B's idle GPUs for a low-priority job; team B comes
back, reclaims its guarantee; A's job checkpoints, is preempted, waits, and later resumes from its checkpoint."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import asyncpg
import nats

from services.api.readmodel import fetch_status
from services.core.preemption import preemption_chains
from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.domain import JobSpec, PodSet
from shared.events import JobSubmitted, make_event
from shared.namespace import subject as ns_subject
from shared.service import publish_event
from tests.system.reclaim_story import BORROWER, CLUSTER, QUEUES, wait_until


async def events_on(nats_url: str, subject: str) -> list[dict]:
    nc = await nats.connect(nats_url)
    sub = await nc.jetstream().subscribe(subject, ordered_consumer=True)
    out = []
    while True:
        try:
            out.append(json.loads((await sub.next_msg(timeout=0.5)).data))
        except TimeoutError:
            break
    await nc.close()
    return out


async def test_team_b_reclaims_from_team_a_which_checkpoints_and_resumes(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    clock = ScaledClock(100.0)
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("admission", "scheduler", "preemption", "executor"), clock=clock)
    borrower = BORROWER
    owner = JobSpec(job_id="b-train", team="team-b", queue="team-b", priority_class="high",
                    pod_sets=(PodSet(count=1, gpus_per_pod=8),), max_runtime_s=1000,
                    labels={"sim.gpuq.io/duration-s": "300"})
    async with Stack(settings):
        nc = await nats.connect(nats_url)
        js = nc.jetstream()

        async def submit(spec: JobSpec) -> None:
            now = datetime.fromtimestamp(clock.now(), UTC)
            await publish_event(js, make_event(JobSubmitted(spec=spec, submitted_at=now), source="test", time=now),
                                JobSubmitted.scoped_subject(spec.team))

        async def state(job_id: str) -> str:
            rows = await fetch_status(database_url, job_id)
            return rows[0]["state"] if rows else "unknown"

        await submit(borrower)
        await wait_until(lambda: _is(state("a-sweep"), "running"))
        await asyncio.sleep(1.0)  # 100 virtual seconds: past the 60 s protection window
        await submit(owner)
        await wait_until(lambda: _is(state("b-train"), "running"))
        await wait_until(lambda: _is(state("b-train"), "completed"))
        await wait_until(lambda: _is(state("a-sweep"), "completed"))
        await nc.close()

    preempted = [e["data"] for e in await events_on(nats_url, ns_subject("job.preempted"))]
    assert len(preempted) == 1
    p = preempted[0]
    assert p["job_id"] == "a-sweep" and p["reason"] == "ReclaimQuota" and p["preemptor"] == "b-train"
    assert p["checkpoint_uri"], "the victim checkpointed before it was preempted"
    # Lost work is what ran after the checkpoint: far less than the 16 GPUs × ~100 s it had run.
    assert p["lost_gpu_seconds"] < 16 * 100
    checkpoints = await events_on(nats_url, ns_subject("job.checkpoint_requested"))
    assert [e["data"]["job_id"] for e in checkpoints] == ["a-sweep"]
    requeued = [e["data"] for e in await events_on(nats_url, ns_subject("job.requeued"))]
    assert [r["resume_from"] for r in requeued] == [p["checkpoint_uri"]]
    placed = [e["data"] for e in await events_on(nats_url, ns_subject("job.placed"))
              if e["data"]["job_id"] == "a-sweep"]
    assert len(placed) == 2 and placed[1]["resume_from"] == p["checkpoint_uri"]
    # Hops per preemption (issue "One house"): the bus handoffs from the request to the preemptor's placement.
    history = [e for kind in ("preemption.requested", "job.checkpoint_requested", "job.checkpointed", "job.preempted",
                              "job.admitted", "job.placed") for e in await events_on(nats_url, ns_subject(kind))]
    (chain,) = preemption_chains(history)
    print(f"\nhops per preemption: {chain.hops} ({' -> '.join(chain.steps)})")
    assert (chain.victim, chain.preemptor) == ("a-sweep", "b-train")
    assert chain.steps == ("preemption.requested", "job.checkpoint_requested", "job.checkpointed", "job.preempted",
                           "job.admitted", "job.placed")
    conn = await asyncpg.connect(database_url)
    run = await conn.fetchrow("SELECT attempt, done_s FROM executor.runs WHERE job_id = 'a-sweep'")
    await conn.close()
    assert run["attempt"] == 2 and run["done_s"] > 0  # resumed with the checkpointed progress


async def _is(value, expected: str) -> bool:  # type: ignore[no-untyped-def]
    return (await value) == expected
