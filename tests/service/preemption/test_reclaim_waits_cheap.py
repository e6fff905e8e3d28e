"""Issue 49 through the real preemption service (NATS + Postgres, the scheduler placing the jobs): a reclaim whose
only victim eligible now would throw away a 10-hour run that cannot checkpoint waits for the checkpointing
borrower that started before the lender asked and leaves its protection window within the lender's deadline, as
the decision loop's chooser does in the simulator (`Preemptor.waiting_since`: the service reads when the reclaim
was first asked from its requests table)."""

from __future__ import annotations

from shared.clock import ManualClock
from shared.config import parse_queues
from shared.events import NodeInventory, PreemptionReason, PreemptionRequested
from shared.namespace import subject as ns_subject
from tests.service.preemption.test_protocol import MODEL, NODES, T0, Harness, spec

QUEUES = parse_queues({
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [{"name": "team-a", "cohort": "research", "quotas": {MODEL: {"nominal": 0}}},
               {"name": "team-b", "cohort": "research", "quotas": {MODEL: {"nominal": 16}}}],
    "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300, "max_victim_loss_s": 1800,
               "loss_aware_reclaim": True},
})


async def test_a_reclaim_waits_for_the_cheap_borrower_instead_of_a_long_run(fresh: tuple[str, str]) -> None:
    clock = ManualClock(T0 + 50_000)
    async with Harness(*fresh, clock, QUEUES) as h:
        await h.send(NodeInventory(nodes=NODES))
        await h.until("SELECT count(*) = 2 FROM scheduler.v1_nodes WHERE NOT removed")
        await h.run_job(spec("a-old", "team-a", "low", ckpt=False, max_runtime_s=7 * 86_400), clock.now() - 36_000)
        await h.run_job(spec("a-young", "team-a", "low", ckpt=True, max_runtime_s=7 * 86_400), clock.now() - 100)
        await h.admission(spec("b-back", "team-b", "high"))
        await h.send(PreemptionRequested(preemptor="b-back", queue="team-b", reason=PreemptionReason.RECLAIM,
                                         need={MODEL: 8}))
        outcome = await h.until("SELECT outcome FROM preemption.requests WHERE preemptor = 'b-back'")
        message = await h.until("SELECT message FROM preemption.requests WHERE preemptor = 'b-back'")
        assert str(message).startswith("WaitingForCheaperVictims")
        assert outcome == "deferred"  # not a-old now: 10 hours of work would be lost
        retry_at = await h.until("SELECT retry_at FROM preemption.deferred WHERE preemptor = 'b-back'")
        assert retry_at == clock.now() - 100 + 600  # when a-young's protection ends, within the lender's deadline
        clock.advance(501)
        await h.until("SELECT 1 FROM preemption.preemptions WHERE victim = 'a-young' AND state = 'checkpointing'")
        requested = await h.outbox(ns_subject("job.checkpoint_requested"))
        assert [r["job_id"] for r in requested] == ["a-young"]  # the long run is kept
