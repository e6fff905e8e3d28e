"""A reclaim of borrowed CPU through the real preemption service (NATS + Postgres, the scheduler placing the jobs):
admission's PreemptionRequested names only `cpu_milli`; the service counts each running job's CPU charge and keeps
the preemptor's own GPU models, so it asks the newest CPU borrower to checkpoint (issue 48 item 5)."""

from __future__ import annotations

from shared.clock import ManualClock
from shared.config import parse_queues
from shared.domain import CheckpointSpec, JobSpec, PodSet
from shared.events import NodeInventory, PreemptionReason, PreemptionRequested
from shared.namespace import subject as ns_subject
from tests.service.preemption.test_protocol import MODEL, NODES, T0, Harness

QUEUES = parse_queues({
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [{"name": q, "cohort": "research", "quotas": {MODEL: {"nominal": 8}, "cpu_milli": {"nominal": 4000}}}
               for q in ("team-a", "team-b")],
    "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300},
})


def spec(job_id: str, queue: str, klass: str, gpus: int = 0) -> JobSpec:
    """3 CPUs, and `gpus` GPUs."""
    return JobSpec(job_id=job_id, team=queue, queue=queue, priority_class=klass,
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus, gpu_models=(MODEL,), cpu_milli=3000, memory_mib=0),),
                   checkpoint=CheckpointSpec(supported=True, interval_s=3600))


async def test_a_cpu_reclaim_finds_the_cpu_borrower(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 5000)
    async with Harness(*fresh, clock, QUEUES) as h:
        await h.send(NodeInventory(nodes=NODES))
        await h.until("SELECT count(*) = 2 FROM scheduler.v1_nodes WHERE NOT removed")
        await h.run_job(spec("a-own", "team-a", "low"), T0)  # CPU work: 3 of team-a's 4 CPUs
        await h.run_job(spec("a-borrowed", "team-a", "low"), T0 + 100)  # 6 CPUs: 2 borrowed from team-b
        # a GPU job of team-b: its GPU fits, 2 of its 4 CPUs are lent
        await h.admission(spec("b-back", "team-b", "high", gpus=1))
        await h.send(PreemptionRequested(preemptor="b-back", queue="team-b", reason=PreemptionReason.RECLAIM,
                                         need={"cpu_milli": 2000}, candidates=("a-borrowed", "a-own")))
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = 'a-borrowed' AND state = 'checkpointing'")
        requested = await h.outbox(ns_subject("job.checkpoint_requested"))
        assert [r["job_id"] for r in requested] == ["a-borrowed"]  # the newer: less work lost; a-own is kept
