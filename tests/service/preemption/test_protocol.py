"""The checkpoint-before-preempt protocol on real NATS + Postgres, including restarts in the middle.

Team A borrows team B's idle GPUs with a low-priority job; team B's job comes back and admission asks to
reclaim. The preemption service asks A's job to checkpoint, waits, preempts it exactly once with the checkpoint
URI — even when it is restarted between the request and the checkpoint — or, without a checkpoint, preempts
when the grace elapses on the runtime clock. A job 5 minutes from its end is left alone."""

from __future__ import annotations

import asyncio

import asyncpg
import nats

from services.preemption.app import PreemptionService
from services.preemption.visibility import preemptible_in_queue, preemption_status
from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import CheckpointSpec, GpuBinding, JobSpec, NodeSpec, PodSet
from shared.events import (
    JobCheckpointed,
    JobPlaced,
    JobStarted,
    JobSubmitted,
    NodeInventory,
    PreemptionReason,
    PreemptionRequested,
    make_event,
    utcnow_from,
)
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime, default_subject, publish_event

MODEL = "H100-80GB"
T0 = 1_700_000_000.0
QUEUES = parse_queues({
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [{"name": "team-a", "cohort": "research", "quotas": {MODEL: {"nominal": 8}}},
               {"name": "team-b", "cohort": "research", "quotas": {MODEL: {"nominal": 8}}}],
    "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300},
})
NODES = tuple(NodeSpec(name=f"n-{i}", gpus=8, gpu_model=MODEL, cpu_milli=96000, memory_mib=1 << 20, rack="r-0",
                       block="b-0") for i in range(2))


def spec(job_id: str, queue: str, klass: str, gpus: int = 8, ckpt: bool = True, max_runtime_s: int = 36000) -> JobSpec:
    return JobSpec(job_id=job_id, team=queue, queue=queue, priority_class=klass, max_runtime_s=max_runtime_s,
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus, cpu_milli=0, memory_mib=0),),
                   checkpoint=CheckpointSpec(supported=ckpt, interval_s=3600 if ckpt else None))


class Harness:
    def __init__(self, nats_url: str, database_url: str, clock: ManualClock):
        self.nats_url, self.database_url, self.clock = nats_url, database_url, clock
        self.runtime: ServiceRuntime | None = None

    async def __aenter__(self) -> Harness:
        self.pool = await create_pool(self.database_url)
        self.nc = await nats.connect(self.nats_url)
        self.js = self.nc.jetstream()
        # The nodes' owner: the preemption service reads them from the scheduler's read model.
        self.scheduler = ServiceRuntime(SchedulerService().spec(), nats_url=self.nats_url, pool=self.pool,
                                        clock=self.clock, database_url=self.database_url)
        await self.scheduler.start()
        await self.start()
        return self

    async def start(self) -> None:
        service = PreemptionService(QUEUES, tick_s=0.05)
        self.runtime = ServiceRuntime(service.spec(), nats_url=self.nats_url, pool=self.pool, clock=self.clock,
                                      database_url=self.database_url)
        await self.runtime.start()

    async def stop(self) -> None:
        assert self.runtime is not None
        await self.runtime.stop()
        self.runtime = None

    async def __aexit__(self, *exc: object) -> None:
        if self.runtime is not None:
            await self.stop()
        await self.scheduler.stop()
        await self.nc.close()
        await self.pool.close()

    async def send(self, payload) -> None:  # type: ignore[no-untyped-def]
        event = make_event(payload, source="test", time=utcnow_from(self.clock.now()))
        await publish_event(self.js, event, default_subject(payload))

    async def until(self, sql: str, *args: object, timeout: float = 20.0) -> object:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            async with self.pool.acquire() as conn:
                value = await conn.fetchval(sql, *args)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for: {sql} {args}")
            await asyncio.sleep(0.05)

    async def outbox(self, subject: str) -> list[dict]:
        import json

        async with self.pool.acquire() as conn:
            rows = await conn.fetch("SELECT body FROM preemption.outbox WHERE subject = $1 ORDER BY seq", subject)
        return [json.loads(bytes(r["body"]))["data"] for r in rows]

    async def run_job(self, s: JobSpec, node: str, started_at: float) -> None:
        await self.send(JobSubmitted(spec=s, submitted_at=utcnow_from(started_at)))
        await self.send(JobPlaced(job_id=s.job_id, spec=s, placed_at=utcnow_from(started_at), bindings=(
            GpuBinding(pod="main-0", node=node, gpu_indices=tuple(range(s.pod_sets[0].gpus_per_pod))),)))
        await self.send(JobStarted(job_id=s.job_id, started_at=utcnow_from(started_at)))
        await self.until("SELECT 1 FROM preemption.jobs WHERE job_id = $1 AND status = 'running'", s.job_id)


async def _setup(h: Harness, victim_ckpt: bool = True) -> None:
    await h.send(NodeInventory(nodes=NODES))
    await h.until("SELECT count(*) = 2 FROM scheduler.v1_nodes WHERE NOT removed")
    await h.run_job(spec("a-own", "team-a", "low", ckpt=False), "n-0", T0)  # team-a's nominal 8
    await h.run_job(spec("a-borrowed", "team-a", "low", ckpt=victim_ckpt), "n-1", T0 + 100)  # 8 borrowed from B
    await h.send(JobSubmitted(spec=spec("b-back", "team-b", "high"), submitted_at=utcnow_from(T0 + 5000)))
    await h.until("SELECT 1 FROM preemption.jobs WHERE job_id = 'b-back'")


async def test_reclaim_checkpoints_then_preempts_exactly_once_across_a_restart(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock) as h:
        await _setup(h)
        await h.send(PreemptionRequested(preemptor="b-back", queue="team-b", reason=PreemptionReason.RECLAIM,
                                         need={MODEL: 8}, candidates=("a-borrowed",)))
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = 'a-borrowed' AND state = 'checkpointing'")
        await h.until("SELECT count(*) FROM preemption.outbox WHERE published_at IS NOT NULL "
                      f"AND subject = '{ns_subject('job.checkpoint_requested')}'")
        requested = await h.outbox(ns_subject("job.checkpoint_requested"))
        assert [r["job_id"] for r in requested] == ["a-borrowed"]  # the newer job: less work lost
        pid = requested[0]["preemption_id"]

        # the service dies mid-protocol; the request is redelivered-proof and the victim is not lost
        await h.stop()
        clock.advance(30)
        await h.start()
        await h.send(JobCheckpointed(job_id="a-borrowed", uri="s3://ckpt/a-borrowed/step-42", step=42,
                                     checkpointed_at=utcnow_from(clock.now()), preemption_id=pid))
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = 'a-borrowed' AND state = 'preempted'")
        # a duplicate request and a late duplicate checkpoint change nothing
        await h.send(JobCheckpointed(job_id="a-borrowed", uri="s3://ckpt/a-borrowed/step-43", step=43,
                                     checkpointed_at=utcnow_from(clock.now()), preemption_id=pid))
        clock.advance(1000)  # far past the grace: the deadline loop must not preempt it again
        await asyncio.sleep(0.5)
        preempted = await h.outbox(ns_subject("job.preempted"))
        assert len(preempted) == 1
        p = preempted[0]
        assert p["job_id"] == "a-borrowed" and p["preemptor"] == "b-back" and p["reason"] == "ReclaimQuota"
        assert p["checkpoint_uri"] == "s3://ckpt/a-borrowed/step-42"
        assert p["lost_gpu_seconds"] == 0.0  # preempted the instant its checkpoint arrived
        async with h.pool.acquire() as conn:
            record = await conn.fetchrow("SELECT * FROM preemption.preemptions WHERE victim = 'a-borrowed'")
            assert record["reason"] == "ReclaimQuota" and record["preemptor"] == "b-back"
            assert record["checkpoint_step"] == 42
            lines = await preemption_status(conn, "a-borrowed", clock.now())
        assert any("preempted for b-back" in line and "step-42" in line for line in lines)


async def test_without_checkpoint_the_grace_elapses_on_the_runtime_clock(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock) as h:
        await _setup(h, victim_ckpt=True)
        async with h.pool.acquire() as conn:
            exposures = await preemptible_in_queue(conn, "team-a", clock.now())
        assert [(e.job_id, e.takeable) for e in exposures] == [("a-borrowed", True), ("a-own", True)]
        await h.send(PreemptionRequested(preemptor="b-back", queue="team-b", reason=PreemptionReason.RECLAIM,
                                         need={MODEL: 8}))
        await h.until("SELECT 1 FROM preemption.preemptions WHERE state = 'checkpointing'")
        await asyncio.sleep(0.3)
        assert await h.outbox(ns_subject("job.preempted")) == []  # still inside the grace
        await h.stop()
        clock.advance(301)  # the grace elapses while the service is down
        await h.start()
        await h.until("SELECT 1 FROM preemption.preemptions WHERE state = 'preempted'")
        preempted = await h.outbox(ns_subject("job.preempted"))
        assert len(preempted) == 1 and preempted[0]["checkpoint_uri"] is None
        # lost work: 8 GPUs since its start (T0+100) until the preemption (T0+5301)
        assert preempted[0]["lost_gpu_seconds"] == 8 * (5301 - 100)


async def test_a_job_five_minutes_from_its_end_is_left_alone(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock) as h:
        await h.send(NodeInventory(nodes=NODES[:1]))
        await h.until("SELECT count(*) = 1 FROM scheduler.v1_nodes WHERE NOT removed")
        # started at T0+1000 with a 4300 s limit: its expected end is T0+5300, 5 minutes from now
        await h.run_job(spec("a-ending", "team-a", "low", max_runtime_s=4300), "n-0", T0 + 1000)
        await h.send(JobSubmitted(spec=spec("a-high", "team-a", "high"), submitted_at=utcnow_from(T0 + 5000)))
        await h.until("SELECT 1 FROM preemption.jobs WHERE job_id = 'a-high'")
        await h.send(PreemptionRequested(preemptor="a-high", queue="team-a", reason=PreemptionReason.PRIORITY))
        outcome = await h.until("SELECT outcome FROM preemption.requests WHERE preemptor = 'a-high'")
        assert outcome == "no_victims"
        async with h.pool.acquire() as conn:
            message = await conn.fetchval("SELECT message FROM preemption.requests WHERE preemptor = 'a-high'")
            lines = await preemption_status(conn, "a-ending", clock.now())
        assert "NoCandidates" in message
        assert any("ProtectedNearEnd" in line for line in lines)
        assert await h.outbox(ns_subject("job.checkpoint_requested")) == []
        conn2 = await asyncpg.connect(h.database_url)
        assert await conn2.fetchval("SELECT count(*) FROM preemption.preemptions") == 0
        await conn2.close()


async def _young_borrower(h: Harness, clock: ManualClock) -> None:
    """Team A runs 16 GPUs (8 borrowed from B) in two jobs that cannot checkpoint and started 50 and 100 s ago."""
    await h.send(NodeInventory(nodes=NODES))
    await h.until("SELECT count(*) = 2 FROM scheduler.v1_nodes WHERE NOT removed")
    await h.run_job(spec("a-own", "team-a", "low", ckpt=False), "n-0", clock.now() - 50)
    await h.run_job(spec("a-young", "team-a", "low", ckpt=False), "n-1", clock.now() - 100)
    await h.send(JobSubmitted(spec=spec("b-back", "team-b", "high"), submitted_at=utcnow_from(clock.now())))
    await h.until("SELECT 1 FROM preemption.jobs WHERE job_id = 'b-back'")
    await h.send(PreemptionRequested(preemptor="b-back", queue="team-b", reason=PreemptionReason.RECLAIM,
                                     need={MODEL: 8}))
    outcome = await h.until("SELECT outcome FROM preemption.requests WHERE preemptor = 'b-back'")
    assert outcome == "deferred"  # every candidate is inside its protection window (600 s)
    retry_at = await h.until("SELECT retry_at FROM preemption.deferred WHERE preemptor = 'b-back'")
    assert retry_at == clock.now() - 100 + 600  # when the first of the two protections ends


async def test_a_reclaim_blocked_by_protection_is_retried_when_protection_ends(fresh: tuple[str, str]) -> None:
    """The lender gets its nominal quota back within the protection window, though no borrower can checkpoint
    and admission sends its reclaim request only once."""
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock) as h:
        await _young_borrower(h, clock)
        clock.advance(400)  # still protected: nothing happens
        await asyncio.sleep(0.3)
        assert await h.outbox(ns_subject("job.preempted")) == []
        await h.stop()  # the deferred request survives a restart
        clock.advance(101)  # a-young's protection ended at +500, a-own's ends at +550
        await h.start()
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = 'a-young' AND state = 'preempted'")
        preempted = await h.outbox(ns_subject("job.preempted"))
        assert [(p["job_id"], p["preemptor"], p["reason"]) for p in preempted] == [
            ("a-young", "b-back", "ReclaimQuota")]
        pid = preempted[0]["preemption_id"]
        assert pid.endswith("/retry-1")
        clock.advance(1000)
        await asyncio.sleep(0.3)
        assert len(await h.outbox(ns_subject("job.preempted"))) == 1  # retried once, preempted once
        async with h.pool.acquire() as conn:
            assert await conn.fetchval("SELECT count(*) FROM preemption.deferred") == 0
            outcomes = [tuple(r) for r in await conn.fetch(
                "SELECT preemption_id, outcome FROM preemption.requests WHERE preemptor = 'b-back' "
                "ORDER BY requested_at")]
        assert [o for _, o in outcomes] == ["deferred", "started"]
        assert outcomes[1][0] == f"{outcomes[0][0]}/retry-1"


async def test_a_deferred_reclaim_is_dropped_once_the_preemptor_is_placed(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock) as h:
        await _young_borrower(h, clock)
        b = spec("b-back", "team-b", "high")
        await h.send(JobPlaced(job_id="b-back", spec=b, placed_at=utcnow_from(clock.now()), bindings=(
            GpuBinding(pod="main-0", node="n-1", gpu_indices=tuple(range(8))),)))
        await h.until("SELECT NOT EXISTS (SELECT 1 FROM preemption.deferred WHERE preemptor = 'b-back')")
        clock.advance(1000)
        await asyncio.sleep(0.3)
        assert await h.outbox(ns_subject("job.preempted")) == []
        async with h.pool.acquire() as conn:
            assert await conn.fetchval("SELECT count(*) FROM preemption.preemptions") == 0
