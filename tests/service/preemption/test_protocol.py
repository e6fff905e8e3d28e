"""The checkpoint-before-preempt protocol on real NATS + Postgres, including restarts in the middle.

Team A borrows team B's idle GPUs with a low-priority job; team B's job comes back and admission asks to
reclaim. The preemption service asks A's job to checkpoint, waits, preempts it exactly once with the checkpoint
URI — even when it is restarted between the request and the checkpoint — or, without a checkpoint, preempts
when the grace elapses on the runtime clock. A job 5 minutes from its end is left alone.

The running jobs are the scheduler's fact: a real scheduler places them (JobAdmitted in, its read model out), and
the executor's part is played by sending JobStarted / JobCompleted. A preemptor is admission's fact: the harness
writes its row in admission's table as admission would (`Harness.admission`), and preemption reads it through
admission's read model."""

from __future__ import annotations

import asyncio
import json

import asyncpg
import nats
from typer.testing import CliRunner

from cli.main import app
from services.admission.app import MIGRATIONS as ADMISSION_MIGRATIONS
from services.preemption.app import PreemptionService
from services.preemption.visibility import preemptible_in_queue, preemption_status
from services.scheduler import readmodel
from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.config import QueuesConfig, parse_queues, queues_document, queues_hash
from shared.db import apply_migrations, create_pool
from shared.domain import CheckpointSpec, JobSpec, NodeSpec, PodSet
from shared.events import (
    JobAdmitted,
    JobCheckpointed,
    JobCompleted,
    JobStarted,
    NodeInventory,
    PreemptionReason,
    PreemptionRequested,
    make_event,
    utcnow_from,
)
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime, default_subject, publish_event
from shared.timefmt import human_time

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
    def __init__(self, nats_url: str, database_url: str, clock: ManualClock, queues: QueuesConfig = QUEUES):
        self.nats_url, self.database_url, self.clock = nats_url, database_url, clock
        self.queues = queues
        self.runtime: ServiceRuntime | None = None

    async def __aenter__(self) -> Harness:
        self.pool = await create_pool(self.database_url)
        self.nc = await nats.connect(self.nats_url)
        self.js = self.nc.jetstream()
        # The owner of nodes and placements: the preemption service reads them from the scheduler's read model.
        await self.start_scheduler()
        # Admission's schema, for its read models: the preemptors (rows written by `admission`) and the queue
        # configuration in force, which admission records at its start (the version preemption runs on).
        await apply_migrations(self.pool, "admission", ADMISSION_MIGRATIONS)
        await self.pool.execute(
            "INSERT INTO admission.config(applied_at, document, applied_by, hash, source) "
            "VALUES ($1, $2, 'file', $3, 'file')", self.clock.now(), json.dumps(queues_document(self.queues)),
            queues_hash(self.queues))
        await self.start()
        return self

    async def start_scheduler(self) -> None:
        self.scheduler: ServiceRuntime | None = ServiceRuntime(
            SchedulerService().spec(), nats_url=self.nats_url, pool=self.pool, clock=self.clock,
            database_url=self.database_url)
        await self.scheduler.start()

    async def stop_scheduler(self) -> None:
        assert self.scheduler is not None
        await self.scheduler.stop()
        self.scheduler = None

    async def start(self) -> None:
        service = PreemptionService(self.queues, tick_s=0.05)
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
        if self.scheduler is not None:
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
        async with self.pool.acquire() as conn:
            rows = await conn.fetch("SELECT body FROM preemption.outbox WHERE subject = $1 ORDER BY seq", subject)
        return [json.loads(bytes(r["body"]))["data"] for r in rows]

    async def admission(self, s: JobSpec, status: str = "pending") -> None:
        """The job as admission records it (admission.jobs, behind its read model admission.v1_jobs)."""
        flavors = json.dumps({"main": MODEL}) if status == "admitted" else None
        async with self.pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO admission.jobs(job_id, team, queue, spec, status, submitted_at, flavors) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (job_id) DO UPDATE SET status = excluded.status, "
                "flavors = excluded.flavors", s.job_id, s.team, s.queue, s.model_dump_json(), status,
                self.clock.now(), flavors)

    async def admit(self, s: JobSpec) -> None:
        """Admission admits the job: its row, and JobAdmitted to the scheduler, which places it when it fits."""
        await self.admission(s, "admitted")
        await self.send(JobAdmitted(job_id=s.job_id, spec=s, flavors={"main": MODEL},
                                    admitted_at=utcnow_from(self.clock.now())))

    async def placed(self, job_id: str) -> readmodel.PlacementFact | None:
        async with self.pool.acquire() as conn:
            found = await readmodel.placements(conn, [job_id])
        return found[0] if found else None

    async def run_job(self, s: JobSpec, started_at: float) -> None:
        """Admitted, placed by the scheduler, started by its executor at `started_at` (the scheduler's read model
        then has the start)."""
        await self.admit(s)
        await self.until("SELECT 1 FROM scheduler.v1_placements WHERE job_id = $1", s.job_id)
        await self.send(JobStarted(job_id=s.job_id, started_at=utcnow_from(started_at)))
        await self.until("SELECT 1 FROM scheduler.v1_placements WHERE job_id = $1 AND started_at = $2",
                         s.job_id, started_at)


async def _setup(h: Harness, victim_ckpt: bool = True) -> None:
    await h.send(NodeInventory(nodes=NODES))
    await h.until("SELECT count(*) = 2 FROM scheduler.v1_nodes WHERE NOT removed")
    await h.run_job(spec("a-own", "team-a", "low", ckpt=False), T0)  # team-a's nominal 8
    await h.run_job(spec("a-borrowed", "team-a", "low", ckpt=victim_ckpt), T0 + 100)  # 8 borrowed from B
    await h.admission(spec("b-back", "team-b", "high"))  # waits for team-b's quota


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
        # `gpuq preemptible` reads the same (the running jobs from the scheduler's read model)
        result = await asyncio.to_thread(CliRunner().invoke, app, [
            "preemptible", "--queue", "team-a", "--json", "--database-url", h.database_url])
        assert result.exit_code == 0, result.output
        assert [(r["job_id"], r["gpus"]) for r in json.loads(result.stdout)] == [("a-borrowed", 8), ("a-own", 8)]
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
        await h.run_job(spec("a-ending", "team-a", "low", max_runtime_s=4300), T0 + 1000)
        await h.admission(spec("a-high", "team-a", "high"))
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
    await h.run_job(spec("a-own", "team-a", "low", ckpt=False), clock.now() - 50)
    await h.run_job(spec("a-young", "team-a", "low", ckpt=False), clock.now() - 100)
    await h.admission(spec("b-back", "team-b", "high"))
    await h.send(PreemptionRequested(preemptor="b-back", queue="team-b", reason=PreemptionReason.RECLAIM,
                                     need={MODEL: 8}))
    outcome = await h.until("SELECT outcome FROM preemption.requests WHERE preemptor = 'b-back'")
    assert outcome == "deferred"  # every candidate is inside its protection window (600 s)
    retry_at = await h.until("SELECT retry_at FROM preemption.deferred WHERE preemptor = 'b-back'")
    assert retry_at == clock.now() - 100 + 600  # when the first of the two protections ends
    message = await h.until("SELECT message FROM preemption.requests WHERE preemptor = 'b-back'")
    assert f"retry at {human_time(retry_at)} when protection ends" in message  # human and zoned, no raw epoch


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
        await h.admit(spec("b-back", "team-b", "high"))  # admitted meanwhile; placed once a-young is done
        await h.send(JobCompleted(job_id="a-young", finished_at=utcnow_from(clock.now())))
        await h.until("SELECT 1 FROM scheduler.v1_placements WHERE job_id = 'b-back'")
        clock.advance(1000)  # the retry comes and finds the preemptor placed: nothing is preempted for it
        await h.until("SELECT NOT EXISTS (SELECT 1 FROM preemption.deferred WHERE preemptor = 'b-back')")
        await asyncio.sleep(0.3)
        assert await h.outbox(ns_subject("job.preempted")) == []
        async with h.pool.acquire() as conn:
            assert await conn.fetchval("SELECT count(*) FROM preemption.preemptions") == 0
            outcomes = [r["outcome"] for r in await conn.fetch(
                "SELECT outcome FROM preemption.requests WHERE preemptor = 'b-back' ORDER BY requested_at")]
        assert outcomes == ["deferred", "preemptor_not_waiting"]


THREE_CLASSES = parse_queues({
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "mid", "value": 100, "preemptible": True},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [{"name": "team-a", "cohort": "research", "quotas": {MODEL: {"nominal": 16}}}],
    "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300},
})


async def test_a_request_refused_for_the_cool_down_is_run_again_when_it_ends(fresh: tuple[str, str]) -> None:
    """a-mid is preempted for a-high; waiting again, it asks for room, which only a-low (lower priority) can
    make. It is refused while it cools down (no cascades: 600 s after its preemption) and, though admission
    sends a request once, run again when the cool-down ends: then a-low, out of its protection window by then,
    is preempted for it."""
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock, queues=THREE_CLASSES) as h:
        await h.send(NodeInventory(nodes=NODES))
        await h.until("SELECT count(*) = 2 FROM scheduler.v1_nodes WHERE NOT removed")
        # neither can checkpoint; both lose less than the 1,800 s loss bound when preempted
        await h.run_job(spec("a-mid", "team-a", "mid", ckpt=False), clock.now() - 1000)
        await h.run_job(spec("a-low", "team-a", "low", ckpt=False), clock.now() - 100)  # protected until +500
        await h.admit(spec("a-high", "team-a", "high"))
        await h.send(PreemptionRequested(preemptor="a-high", queue="team-a", reason=PreemptionReason.PRIORITY))
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = 'a-mid' AND state = 'preempted'")
        await h.admission(spec("a-mid", "team-a", "mid", ckpt=False))  # requeued: waiting again
        await h.until("SELECT NOT EXISTS (SELECT 1 FROM scheduler.v1_placements WHERE job_id = 'a-mid')")
        await h.send(PreemptionRequested(preemptor="a-mid", queue="team-a", reason=PreemptionReason.PRIORITY))
        outcome = await h.until("SELECT outcome FROM preemption.requests WHERE preemptor = 'a-mid'")
        assert outcome == "cooldown"
        retry_at = await h.until("SELECT retry_at FROM preemption.deferred WHERE preemptor = 'a-mid'")
        assert retry_at == clock.now() + 600  # preempted at this instant (the manual clock has not moved)
        clock.advance(550)  # a-low is out of its window, a-mid still cooling down: nothing happens
        await asyncio.sleep(0.3)
        assert [p["job_id"] for p in await h.outbox(ns_subject("job.preempted"))] == ["a-mid"]
        clock.advance(51)
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = 'a-low' AND state = 'preempted'")
        preempted = await h.outbox(ns_subject("job.preempted"))
        assert [(p["job_id"], p["preemptor"]) for p in preempted] == [("a-mid", "a-high"), ("a-low", "a-mid")]
        async with h.pool.acquire() as conn:
            outcomes = [r["outcome"] for r in await conn.fetch(
                "SELECT outcome FROM preemption.requests WHERE preemptor = 'a-mid' ORDER BY requested_at")]
            assert await conn.fetchval("SELECT count(*) FROM preemption.deferred") == 0
        assert outcomes == ["cooldown", "started"]


# ---------------------------------------------------------------------- the owners' facts change mid-protocol


async def _open_reclaim(h: Harness) -> str:
    """b-back's reclaim has asked a-borrowed to checkpoint; returns the protocol's id."""
    await _setup(h)
    await h.send(PreemptionRequested(preemptor="b-back", queue="team-b", reason=PreemptionReason.RECLAIM,
                                     need={MODEL: 8}))
    await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = 'a-borrowed' AND state = 'checkpointing'")
    async with h.pool.acquire() as conn:
        pid = await conn.fetchval("SELECT preemption_id FROM preemption.preemptions WHERE victim = 'a-borrowed'")
    return str(pid)


async def _aborted(h: Harness, victim: str) -> str:
    reason = await h.until("SELECT abort_reason FROM preemption.preemptions WHERE victim = $1 AND state = 'aborted'",
                           victim)
    await asyncio.sleep(0.3)
    assert await h.outbox(ns_subject("job.preempted")) == []
    return str(reason)


async def test_a_victim_that_ends_while_its_protocol_is_open_is_not_preempted(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock) as h:
        pid = await _open_reclaim(h)
        await h.send(JobCompleted(job_id="a-borrowed", finished_at=utcnow_from(clock.now())))
        await h.until("SELECT NOT EXISTS (SELECT 1 FROM scheduler.v1_placements WHERE job_id = 'a-borrowed')")
        # its last checkpoint arrives after the end (the executor's events overtake nothing of the scheduler's)
        await h.send(JobCheckpointed(job_id="a-borrowed", uri="s3://ckpt/a-borrowed/last", step=9,
                                     checkpointed_at=utcnow_from(clock.now()), preemption_id=pid))
        assert "victim ended" in await _aborted(h, "a-borrowed")
        # the preemptor is not held up by the aborted protocol: its next request is decided afresh
        await h.send(PreemptionRequested(preemptor="b-back", queue="team-b", reason=PreemptionReason.RECLAIM,
                                         need={MODEL: 8}))
        outcome = await h.until("SELECT outcome FROM preemption.requests WHERE preemptor = 'b-back' "
                                "AND outcome <> 'started'")
        assert outcome != "duplicate"


async def test_a_victim_that_runs_again_under_a_new_placement_is_not_preempted_for_its_old_run(
        fresh: tuple[str, str]) -> None:
    """Its attempt ended and it was placed again before its protocol was looked at: the protocol was for the run
    that ended (its placement time is kept with it), so it is aborted and the new run goes on."""
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock) as h:
        pid = await _open_reclaim(h)
        first = await h.placed("a-borrowed")
        await h.stop()  # preemption hears nothing of this
        await h.send(JobCompleted(job_id="a-borrowed", finished_at=utcnow_from(clock.now())))
        await h.until("SELECT NOT EXISTS (SELECT 1 FROM scheduler.v1_placements WHERE job_id = 'a-borrowed')")
        clock.advance(10)
        await h.admit(spec("a-borrowed", "team-a", "low"))  # its retry, admitted and placed again
        await h.until("SELECT 1 FROM scheduler.v1_placements WHERE job_id = 'a-borrowed'")
        second = await h.placed("a-borrowed")
        assert first is not None and second is not None and second.placed_at != first.placed_at
        await h.start()
        await h.send(JobCheckpointed(job_id="a-borrowed", uri="s3://ckpt/a-borrowed/old", step=3,
                                     checkpointed_at=utcnow_from(clock.now()), preemption_id=pid))
        assert await _aborted(h, "a-borrowed") == "victim ended (it runs again under a new placement)"


async def test_a_victim_whose_preemptor_was_placed_meanwhile_runs_on(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock) as h:
        pid = await _open_reclaim(h)
        await h.admit(spec("b-back", "team-b", "high"))
        await h.send(JobCompleted(job_id="a-own", finished_at=utcnow_from(clock.now())))  # room for b-back
        await h.until("SELECT 1 FROM scheduler.v1_placements WHERE job_id = 'b-back'")
        await h.send(JobCheckpointed(job_id="a-borrowed", uri="s3://ckpt/a-borrowed/step-1", step=1,
                                     checkpointed_at=utcnow_from(clock.now()), preemption_id=pid))
        assert await _aborted(h, "a-borrowed") == "preemptor placed before the checkpoint"
        assert await h.placed("a-borrowed") is not None
        async with h.pool.acquire() as conn:  # the checkpoint is kept: lost work counts from it
            assert await conn.fetchval("SELECT uri FROM preemption.checkpoints WHERE job_id = 'a-borrowed'") == \
                "s3://ckpt/a-borrowed/step-1"


async def test_a_victim_whose_preemptor_was_cancelled_meanwhile_runs_on(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock) as h:
        await _open_reclaim(h)
        await h.admission(spec("b-back", "team-b", "high"), "finished")  # cancelled while it waited
        clock.advance(301)  # the grace elapses without a checkpoint
        assert await _aborted(h, "a-borrowed") == "preemptor no longer waiting (finished)"
        assert await h.placed("a-borrowed") is not None


async def test_a_victim_preempted_is_no_candidate_until_the_scheduler_frees_it(fresh: tuple[str, str]) -> None:
    """Between JobPreempted and the scheduler freeing its GPUs, the read model still lists the victim: a second
    request neither picks it again nor counts its GPUs as taken."""
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock) as h:
        pid = await _open_reclaim(h)
        await h.stop_scheduler()  # it will not hear of the JobPreempted for now
        await h.send(JobCheckpointed(job_id="a-borrowed", uri="s3://ckpt/a-borrowed/step-2", step=2,
                                     checkpointed_at=utcnow_from(clock.now()), preemption_id=pid))
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = 'a-borrowed' AND state = 'preempted'")
        assert await h.placed("a-borrowed") is not None  # still listed by its owner
        async with h.pool.acquire() as conn:
            exposures = await preemptible_in_queue(conn, "team-a", clock.now())
            lines = await preemption_status(conn, "a-borrowed", clock.now())
        assert [e.job_id for e in exposures] == ["a-own"]
        assert "just preempted" in lines[0]
        await h.admission(spec("b-two", "team-b", "high"))
        await h.send(PreemptionRequested(preemptor="b-two", queue="team-b", reason=PreemptionReason.RECLAIM,
                                         need={MODEL: 8}))
        outcome = await h.until("SELECT outcome FROM preemption.requests WHERE preemptor = 'b-two'")
        # a-borrowed's 8 GPUs are as good as free (team-a is within its nominal quota now): nothing to take
        assert outcome in ("no_victims", "fits_without_preemption")
        assert len(await h.outbox(ns_subject("job.preempted"))) == 1
