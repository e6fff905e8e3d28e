"""Defragmentation in the running services (issue 49 item 4), on real NATS + Postgres: the scheduler (with the queue
configuration, defragmentation on) plans a move when a gang waits while enough GPUs are free but scattered and asks
the preemption service (reason DefragmentationMove); that service checkpoints the moved job, preempts it, the
scheduler places the gang on what it freed and the moved job, requeued with its checkpoint, on its hint. A job that
cannot checkpoint is never moved, and the hourly bound holds on both sides (the scheduler's asks, the service's
protocols).

Admission's part (the moved job requeued and admitted again) is played by the test, as in test_protocol.py."""

from __future__ import annotations

import json

from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.config import QueuesConfig, parse_queues
from shared.domain import NodeSpec
from shared.events import (
    JobCheckpointed,
    JobRequeued,
    NodeInventory,
    PreemptionReason,
    PreemptionRequested,
    utcnow_from,
)
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime
from tests.service.preemption.test_protocol import MODEL, T0, Harness, spec


def queues(max_moves_per_hour: int = 12, enabled: bool = True) -> QueuesConfig:
    return parse_queues({
        "priority_classes": [{"name": "low", "value": 0, "preemptible": True}],
        "cohorts": [{"name": "research"}],
        # team-a spreads its jobs (queues.yaml `placement_strategy`): the scattered capacity of the story
        "queues": [{"name": "team-a", "cohort": "research", "quotas": {MODEL: {"nominal": 24}},
                    "placement_strategy": "spread"},
                   {"name": "team-b", "cohort": "research", "quotas": {MODEL: {"nominal": 24}}}],
        "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300,
                   "defragmentation": {"enabled": enabled, "max_moves_per_hour": max_moves_per_hour}},
    })


def nodes(n: int) -> tuple[NodeSpec, ...]:
    return tuple(NodeSpec(name=f"n-{i}", gpus=8, gpu_model=MODEL, cpu_milli=96000, memory_mib=1 << 20, rack="r-0",
                          block="b-0") for i in range(n))


class DefragHarness(Harness):
    """The harness with a scheduler that has the queue configuration (it plans the moves)."""

    async def start_scheduler(self) -> None:
        self.scheduler: ServiceRuntime | None = ServiceRuntime(
            SchedulerService(queues=self.queues).spec(), nats_url=self.nats_url, pool=self.pool, clock=self.clock,
            database_url=self.database_url)
        await self.scheduler.start()


async def _scattered(h: Harness, n: int, ckpt: bool = True) -> dict[str, str]:
    """`n` nodes of 8 GPUs, each running one 4-GPU job of team-a (spread), started long ago. Node -> its job."""
    await h.send(NodeInventory(nodes=nodes(n)))
    await h.until(f"SELECT count(*) = {n} FROM scheduler.v1_nodes WHERE NOT removed")
    for i in range(n):
        await h.run_job(spec(f"m{i + 1}", "team-a", "low", gpus=4, ckpt=ckpt), T0)
    placed = {r: await h.until("SELECT bindings->0->>'node' FROM scheduler.jobs WHERE job_id = $1", r)
              for r in (f"m{i + 1}" for i in range(n))}
    assert sorted(placed.values()) == [f"n-{i}" for i in range(n)]  # one per node: 4 GPUs free on each
    return {str(node): job for job, node in placed.items()}


async def _nodes_of(h: Harness, job_id: str) -> list[str]:
    raw = await h.until("SELECT bindings FROM scheduler.v1_placements WHERE job_id = $1", job_id)
    return sorted({b["node"] for b in json.loads(str(raw))})


async def test_a_scattered_gang_starts_after_a_checkpointing_job_is_moved(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with DefragHarness(*fresh, clock, queues()) as h:
        on = await _scattered(h, 2)
        moved = on["n-0"]  # the nodes miss 4 GPUs each: the first by name, its smallest job
        gang = spec("g", "team-b", "low", gpus=8)
        await h.admit(gang)  # 8 GPUs free, 4 on each node: it cannot be placed
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = $1 AND preemptor = 'g' "
                      "AND reason = 'DefragmentationMove' AND state = 'checkpointing'", moved)
        requested = await h.outbox(ns_subject("job.checkpoint_requested"))
        assert [r["job_id"] for r in requested] == [moved]  # checkpoint first, one job moved
        hint = json.loads(str(await h.until("SELECT bindings FROM scheduler.moves WHERE job_id = $1", moved)))
        assert {b["node"] for b in hint} == {"n-1"}  # its hint: the holes beside the other job
        assert await h.placed("g") is None  # nothing moves before the checkpoint
        await h.send(JobCheckpointed(job_id=moved, uri="s3://ckpt/m/step-7", step=7,
                                     checkpointed_at=utcnow_from(clock.now()),
                                     preemption_id=requested[0]["preemption_id"]))
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = $1 AND state = 'preempted'", moved)
        preempted = await h.outbox(ns_subject("job.preempted"))
        assert [(p["job_id"], p["reason"], p["preemptor"], p["checkpoint_uri"]) for p in preempted] == [
            (moved, "DefragmentationMove", "g", "s3://ckpt/m/step-7")]
        assert await _nodes_of(h, "g") == ["n-0"]  # the gang placed on the node the move emptied
        # its hint is held for it: another job that fits only there waits
        await h.admit(spec("x", "team-b", "low", gpus=4))
        assert await h.until("SELECT reason FROM scheduler.jobs WHERE job_id = 'x'") == "WaitingForReservation"
        # admission requeues the moved job with its checkpoint and admits it again: it lands on its hint
        again = spec(moved, "team-a", "low", gpus=4)
        await h.send(JobRequeued(job_id=moved, spec=again, resume_from="s3://ckpt/m/step-7",
                                 submitted_at=utcnow_from(T0)))
        await h.until("SELECT 1 FROM scheduler.jobs WHERE job_id = $1 AND resume_from = 's3://ckpt/m/step-7'", moved)
        await h.admit(again)
        assert await _nodes_of(h, moved) == ["n-1"]
        async with h.pool.acquire() as conn:
            rows = await conn.fetch("SELECT body FROM scheduler.outbox WHERE subject = $1 ORDER BY seq",
                                    ns_subject("job.placed"))
        placed = [json.loads(bytes(r["body"]))["data"] for r in rows]
        assert [(p["job_id"], p.get("resume_from")) for p in placed if p["job_id"] in ("g", moved)] == [
            (moved, None), ("g", None), (moved, "s3://ckpt/m/step-7")]


async def test_the_plans_free_gpus_are_held_for_the_gang_during_the_checkpoint(fresh: tuple[str, str]) -> None:
    """Between the ask and the moved job's preemption (its checkpoint, up to the grace) the GPUs of the plan that
    are free already wait for the gang: a job arriving then is placed around them, and the gang starts where the
    plan put it."""
    clock = ManualClock(T0 + 5000)
    async with DefragHarness(*fresh, clock, queues()) as h:
        on = await _scattered(h, 2)
        moved = on["n-0"]
        await h.admit(spec("g", "team-b", "low", gpus=8))
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = $1 AND preemptor = 'g' "
                      "AND state = 'checkpointing'", moved)
        # during the checkpoint a 4-GPU job arrives: n-0's 4 free GPUs are the gang's, it takes n-1's
        await h.admit(spec("y", "team-b", "low", gpus=4))
        assert await _nodes_of(h, "y") == ["n-1"]
        # a second one fits only on the held GPUs, and is short enough to backfill before the gang's reservation
        # (the moved job's expected end): it waits all the same, and says what for
        await h.admit(spec("z", "team-b", "low", gpus=4, max_runtime_s=600))
        assert await h.until("SELECT reason FROM scheduler.jobs WHERE job_id = 'z'") == "WaitingForReservation"
        message = str(await h.until("SELECT message FROM scheduler.jobs WHERE job_id = 'z'"))
        assert "GPUs held for g while defragmentation moves jobs" in message
        requested = await h.outbox(ns_subject("job.checkpoint_requested"))
        await h.send(JobCheckpointed(job_id=moved, uri="s3://ckpt/m/step-9", step=9,
                                     checkpointed_at=utcnow_from(clock.now()),
                                     preemption_id=requested[0]["preemption_id"]))
        assert await _nodes_of(h, "g") == ["n-0"]  # the gang on the free GPUs and the moved job's
        async with h.pool.acquire() as conn:  # placed: its holds are gone
            assert await conn.fetchval("SELECT count(*) FROM scheduler.holds WHERE preemptor = 'g'") == 0


async def test_a_job_that_cannot_checkpoint_is_never_moved(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with DefragHarness(*fresh, clock, queues()) as h:
        on = await _scattered(h, 2, ckpt=False)
        await h.admit(spec("g", "team-b", "low", gpus=8))
        # the cycle that found the gang unplaceable (its reason is written in the transaction that would ask)
        await h.until("SELECT reason FROM scheduler.jobs WHERE job_id = 'g'")
        async with h.pool.acquire() as conn:
            assert await conn.fetchval("SELECT count(*) FROM scheduler.moves") == 0
        # asked anyway (a scheduler of another version, or by hand): the preemption service refuses it
        await h.send(PreemptionRequested(preemptor="g", queue="team-b", reason=PreemptionReason.DEFRAGMENTATION,
                                         candidates=(on["n-0"],)))
        outcome = await h.until("SELECT outcome FROM preemption.requests WHERE preemptor = 'g'")
        message = await h.until("SELECT message FROM preemption.requests WHERE preemptor = 'g'")
        assert outcome == "no_victims"
        assert f"{on['n-0']} (cannot checkpoint)" in str(message)
        async with h.pool.acquire() as conn:
            assert await conn.fetchval("SELECT count(*) FROM preemption.preemptions") == 0
        assert await h.outbox(ns_subject("job.checkpoint_requested")) == []


async def test_the_hourly_bound_on_moves_holds(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with DefragHarness(*fresh, clock, queues(max_moves_per_hour=1)) as h:
        on = await _scattered(h, 3)
        await h.admit(spec("g1", "team-b", "low", gpus=8))
        await h.until("SELECT 1 FROM preemption.preemptions WHERE preemptor = 'g1' AND state = 'checkpointing'")
        clock.advance(60)
        await h.admit(spec("g2", "team-b", "low", gpus=8))  # scattered too, and m2 or m3 could be moved for it
        await h.until("SELECT reason FROM scheduler.jobs WHERE job_id = 'g2'")
        async with h.pool.acquire() as conn:
            assert [r["gang"] for r in await conn.fetch("SELECT gang FROM scheduler.moves")] == ["g1"]
        # asked anyway: the preemption service counts its own moves of the last hour
        await h.send(PreemptionRequested(preemptor="g2", queue="team-b", reason=PreemptionReason.DEFRAGMENTATION,
                                         candidates=(on["n-2"],)))
        outcome = await h.until("SELECT outcome FROM preemption.requests WHERE preemptor = 'g2'")
        assert outcome == "rate_limited"
        async with h.pool.acquire() as conn:
            assert [r["victim"] for r in await conn.fetch("SELECT victim FROM preemption.preemptions")] == [on["n-0"]]
        # an hour later the bound has room again: the request is taken
        clock.advance(3600)
        await h.send(PreemptionRequested(preemptor="g2", queue="team-b", reason=PreemptionReason.DEFRAGMENTATION,
                                         candidates=(on["n-2"],)))
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = $1 AND preemptor = 'g2'", on["n-2"])


async def test_admitted_gangs_are_not_moved_for_when_defragmentation_is_off(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with DefragHarness(*fresh, clock, queues(enabled=False)) as h:
        on = await _scattered(h, 2)
        await h.admit(spec("g", "team-b", "low", gpus=8))
        await h.until("SELECT reason FROM scheduler.jobs WHERE job_id = 'g'")
        async with h.pool.acquire() as conn:
            assert await conn.fetchval("SELECT count(*) FROM scheduler.moves") == 0
        await h.send(PreemptionRequested(preemptor="g", queue="team-b", reason=PreemptionReason.DEFRAGMENTATION,
                                         candidates=(on["n-0"],)))
        assert await h.until("SELECT outcome FROM preemption.requests WHERE preemptor = 'g'") == "no_victims"



def test_the_core_names_the_moves_with_the_events_reason() -> None:
    """The decision loop's moves (the simulator's lost-work cause) and the services' events use one reason."""
    from services.core.pipeline.defrag import DEFRAG

    assert PreemptionReason.DEFRAGMENTATION.value == DEFRAG
