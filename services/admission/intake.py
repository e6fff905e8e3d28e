"""Submission intake: a JobSubmitted is judged (rate, identity, team, governance, pending cap, the core's own
refusals), then either refused, cancelled by a cancel that came first, held for an admin's approval, or queued.
Every outcome is one verdict row (admission.submissions) and one audit record; a refusal is a JobRejected."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from services.admission import prefetch
from services.admission.held import held_rows, hold_rows, write_held
from services.admission.memory import Memory, UnitOfWork
from services.core.admission import Rejection, Workload, approval, governance, identity
from services.core.admission.governance import Violation
from services.core.admission.limits import Bucket, pending_refusal, rate_refusal
from services.core.admission.user_limits import user_limit_refusal
from services.core.metering.budget import exhausted_verdict
from services.core.preemption.model import priority_of
from services.metering import budgetmodel
from shared import audit
from shared.audit import team_actor
from shared.config import TeamPolicy
from shared.domain import JobSpec
from shared.events import CloudEvent, JobCancelled, JobPending, JobQueued, JobRejected, JobSubmitted, utcnow_from
from shared.service import Tx


@dataclass(frozen=True)
class Submission:
    """One JobSubmitted being judged, and how its verdict is recorded. The team is the subject's (the runtime
    checked the subject fits the type), never the payload's; queue order starts when admission received it."""

    tx: Tx
    event: CloudEvent
    payload: JobSubmitted
    team: str
    received_at: float

    @classmethod
    def of(cls, tx: Tx, event: CloudEvent, payload: JobSubmitted) -> Submission:
        return cls(tx, event, payload, JobSubmitted.scope_of(tx.subject) or "", tx.now)

    @property
    def spec(self) -> JobSpec:
        return self.payload.spec

    @property
    def actor(self) -> str:
        return team_actor(self.team)

    async def audited(self, kind: str, reason: str | None = None, message: str | None = None) -> None:
        spec = self.spec
        await audit.record(self.tx, "submit" if kind != "rejected" else "submit_refused", self.actor,
                           job_id=spec.job_id, team=self.team, queue=spec.queue, verdict=kind, reason=reason,
                           message=message, claimed_by=self.payload.submitted_by or spec.user, event_id=self.event.id,
                           gpus=spec.total_gpus, priority_class=spec.priority_class)

    async def verdict(self, kind: str, reason: str | None = None, message: str | None = None) -> None:
        await self.tx.conn.execute(
            "INSERT INTO admission.submissions(event_id, job_id, team, verdict, reason, message, at) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (event_id) DO NOTHING",
            self.event.id, self.spec.job_id, self.team, kind, reason, message, self.tx.now)
        await self.audited(kind, reason, message)

    async def reject(self, reason: str, message: str, record_job: bool) -> None:
        """Refused, with a job row (`record_job`: the id is then taken) or without one (the id stays free)."""
        tx, spec, team = self.tx, self.spec, self.team
        if record_job:
            await tx.conn.execute(
                "INSERT INTO admission.jobs(job_id, team, queue, spec, status, submitted_at, reason, message) "
                "VALUES ($1, $2, $3, $4, 'rejected', $5, $6, $7)",
                spec.job_id, spec.team, spec.queue, spec.model_dump_json(), self.received_at, reason, message)
        await tx.conn.execute(
            "INSERT INTO admission.audit(at, actor, action, job_id, detail) VALUES ($1, $2, 'reject', $3, $4)",
            tx.now, self.actor, spec.job_id,
            json.dumps({"reason": reason, "message": message, "team": team, "queue": spec.queue,
                        "event_id": self.event.id, "source": self.event.source}))
        await tx.emit(JobRejected(job_id=spec.job_id, team=team, queue=spec.queue, reason=reason, message=message))
        await self.verdict("rejected", reason, message)


BUDGET_EXHAUSTED = "BudgetExhausted"

# A refusal: (reason, message, whether the refused job gets a row)
Refusal = tuple[str, str, bool]


class SubmissionIntake:
    """Judges submissions against `memory`'s state. `predicted_gpu_s` is the job's predicted GPU-seconds for
    duration-aware ordering (None when off), stored with it at receipt."""

    def __init__(self, memory: Memory, unit: UnitOfWork, predicted_gpu_s: Callable[[JobSpec], float | None]):
        self.memory = memory
        self.unit = unit
        self.predicted_gpu_s = predicted_gpu_s
        # team -> its submission tokens (core/limits.py). In memory: a restarted admission starts every team full.
        self._buckets: dict[str, Bucket] = {}

    async def on_submitted(self, tx: Tx, event: CloudEvent, payload: JobSubmitted) -> None:
        """A submission, authorised by its subject: the team is the subject's, never the payload's. Queue order
        starts at the time admission received it (`tx.now`): a producer cannot backdate a job past others by
        writing an old `submitted_at`."""
        submission = Submission.of(tx, event, payload)

        async def body() -> None:
            await self._judge(submission)

        await self.unit.then_cycle(tx, body)

    async def _judge(self, sub: Submission) -> None:
        refusal, tombstoned = await self._refusal(sub)
        budget = await self._budget_verdict(sub) if refusal is None else None
        if budget is not None and budget[0] == "refuse":
            refusal = (BUDGET_EXHAUSTED, budget[1], False)  # no row: the id stays free (preemptible, or next period)
        if refusal is not None:
            await sub.reject(*refusal)
            return
        spec, state = sub.spec, self.memory.state
        predicted = self.predicted_gpu_s(spec)
        rejection: Rejection | None = state.submit(Workload(spec, sub.received_at, predicted_gpu_s=predicted))
        if rejection is not None:
            await sub.reject(rejection.reason, rejection.message, True)
            return
        if tombstoned and await self._cancelled_before_it_came(sub):
            return
        awaits = approval.approval_reason(spec, state.config.governance.for_team(sub.team), state.config)
        if awaits is None and budget is not None:
            awaits = budget[1]
        if awaits is not None:
            await self._await_approval(sub, awaits, predicted)
            return
        await self._queue(sub, predicted)

    async def _refusal(self, sub: Submission) -> tuple[Refusal | None, bool]:
        """Why the submission is refused before the core sees it, if it is, and whether a cancel for it came
        first (a tombstone, looked up with its id). Every submission on a team's subject
        costs it a token, whatever becomes of it: a flood is refused before anything is looked up, and the id
        stays free (no job row) for when the team submits it again."""
        spec, team, config = sub.spec, sub.team, self.memory.state.config
        limited = rate_refusal(self._buckets, team, spec.job_id, sub.received_at, config.governance.for_team(team))
        if limited is not None:
            return (limited.reason, limited.message, False), False
        refusal, tombstoned = await self._identity_refusal(sub)
        if refusal is not None:
            return refusal, tombstoned
        if spec.team != team:
            # No row either: a row in the named team's view would be a ghost there, and would take the id from it.
            return ("Unauthorized", f"job {spec.job_id} names team {spec.team!r} but was submitted with team "
                                    f"{team!r}'s credential (subject {sub.tx.subject})", False), tombstoned
        policy = config.governance.for_team(team)
        violation = governance.submission_violation(spec, policy, config.team_namespaces(team),
                                                    cpu_queue=governance.charges_cpu(config, spec.queue))
        if violation is not None:
            return (violation.reason, violation.message, True), tombstoned
        crowded = pending_refusal(team, spec.job_id, await self._waiting(sub.tx, spec, team, policy), policy)
        if crowded is not None:
            return (crowded.reason, crowded.message, False), tombstoned  # no row: the id stays free for later
        over = self._user_limit(spec)
        if over is not None:
            return (over.reason, over.message, False), tombstoned  # no row: the id stays free for later
        return None, tombstoned

    async def _budget_verdict(self, sub: Submission) -> tuple[str, str] | None:
        """What the team's spent GPU-hour budget says of the job (core/metering/budget.py): refuse it, hold it for an
        admin's approval, or nothing. Read from metering's read model (metering.v1_budgets), only for a team with a
        budget in the configuration in force."""
        config = self.memory.state.config
        if sub.team not in config.budgets:
            return None
        row = await budgetmodel.exhausted(sub.tx.conn, sub.team, utcnow_from(sub.received_at))
        if row is None:
            return None
        preemptible = priority_of(config, sub.spec)[1]
        return exhausted_verdict(config.budgets[sub.team].on_exhausted, preemptible, sub.team, row.period)

    def _user_limit(self, spec: JobSpec) -> Violation | None:
        """Whether the job takes its user past a per-user limit (core/user_limits.py), counted over the core's
        waiting and admitted jobs (this batch's earlier submissions included: the core has them already)."""
        state = self.memory.state
        config = state.config
        if not spec.user or (config.governance.for_team(spec.team).per_user is None
                             and config.job_class(spec.kind).max_per_user is None):
            return None
        others = [w.spec for w in state.pending.values()] + [a.spec for a in state.admitted.values()]
        return user_limit_refusal(spec, config, others)

    async def _identity_refusal(self, sub: Submission) -> tuple[Refusal | None, bool]:
        """Whether the job id is taken (by which team): an id another team holds, or one reserved for another team
        (`<team>::<name>`), is refused without a row, and in words that say nothing of that team's job
        (core/identity.py); the submitting team's own job id, with its status."""
        tx, spec, team = sub.tx, sub.spec, sub.team
        # The id's holder and whether a cancel for it came first, in one round trip (a tombstone is rare: it is
        # taken in `_cancelled_before_it_came` only when there is one). (In a consumed batch, read for all its
        # submissions at once: services/admission/prefetch.py)
        known = prefetch.take(tx.scratch, spec.job_id, team)
        existing, holder, tombstoned = known if known is not None else await prefetch.lookup(tx.conn, spec.job_id, team)
        earlier = held_rows(tx)
        if existing is None and earlier is not None and spec.job_id in earlier.jobs:
            # queued earlier in this batch, its row not written yet
            existing, holder = "pending", earlier.jobs[spec.job_id][0]
        elif existing is not None and earlier is not None and earlier.updates(spec.job_id):
            # its row changed earlier in this batch (an end, say), not written yet: the refusal says its status
            await write_held(tx)
            existing = await tx.conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", spec.job_id)
        taken = identity.unavailable(spec.job_id, team, holder)
        if taken is not None:
            return (*taken, False), tombstoned
        if existing is not None:  # the submitting team's own job: it may hear its status
            duplicate = f"job id {spec.job_id} was already submitted ({existing})"
            return (identity.DUPLICATE_JOB_ID, duplicate, False), tombstoned
        return None, tombstoned

    async def _waiting(self, tx: Tx, spec: JobSpec, team: str, policy: TeamPolicy) -> int:
        """The team's jobs waiting in its queues (the core's count), and for a job that would wait for an admin's
        approval also those already waiting for one (held outside the queues, so counted in the table)."""
        state = self.memory.state
        waiting = state.pending_of(team)
        if policy.max_pending_jobs is not None and approval.approval_reason(spec, policy, state.config):
            waiting += await tx.conn.fetchval(
                "SELECT count(*) FROM admission.jobs WHERE team = $1 AND status = 'pending' AND approval = 'required'",
                team)
        return waiting

    async def _cancelled_before_it_came(self, sub: Submission) -> bool:
        """A cancel for this job that arrived before it (its tombstone, taken now): it never waits, and everyone
        hears it is cancelled."""
        tx, spec, team = sub.tx, sub.spec, sub.team
        tombstone = await tx.conn.fetchrow(
            "DELETE FROM admission.tombstones WHERE job_id = $1 AND team = $2 RETURNING requested_at, event_id",
            spec.job_id, team)
        if tombstone is None:
            return False
        self.memory.state.finish(spec.job_id)
        await tx.conn.execute(
            "INSERT INTO admission.jobs(job_id, team, queue, spec, status, submitted_at, finished_at, outcome)"
            " VALUES ($1, $2, $3, $4, 'finished', $5, $5, 'Cancelled')",
            spec.job_id, team, spec.queue, spec.model_dump_json(), sub.received_at)
        await tx.emit(JobCancelled(job_id=spec.job_id, by=sub.actor, reason="cancelled before it was received",
                                   cancelled_at=utcnow_from(tx.now)))
        await sub.verdict("cancelled", "Cancelled", "a cancel for this job arrived before the job")
        return True

    async def _await_approval(self, sub: Submission, awaits: str, predicted: float | None) -> None:
        tx, spec, team = sub.tx, sub.spec, sub.team
        self.memory.state.finish(spec.job_id)  # held outside the queue until an admin approves it
        message = f"{awaits}: gpuq approve {spec.job_id}"
        await tx.conn.execute(
            "INSERT INTO admission.jobs(job_id, team, queue, spec, status, submitted_at, approval, reason, "
            "message, predicted_gpu_s) VALUES ($1, $2, $3, $4, 'pending', $5, 'required', $6, $7, $8)",
            spec.job_id, team, spec.queue, spec.model_dump_json(), sub.received_at,
            governance.AWAITING_APPROVAL, message, predicted)
        await tx.emit(JobQueued(job_id=spec.job_id, queue=spec.queue, team=team))
        await tx.emit(JobPending(job_id=spec.job_id, queue=spec.queue, reason=governance.AWAITING_APPROVAL,
                                 message=message))
        await sub.verdict("awaiting_approval", governance.AWAITING_APPROVAL, message)

    async def _queue(self, sub: Submission, predicted: float | None) -> None:
        tx, spec, team = sub.tx, sub.spec, sub.team
        await tx.emit(JobQueued(job_id=spec.job_id, queue=spec.queue, team=team))
        row = (team, spec.queue, spec.model_dump_json(), sub.received_at, predicted)
        if not self.unit.may_hold(tx):
            # written at once: in a savepoint of its own (see Tx.own_savepoint), or where `claim` reads the
            # table before a later message's handler runs
            await tx.conn.execute(
                "INSERT INTO admission.jobs(job_id, team, queue, spec, status, submitted_at, predicted_gpu_s) "
                "VALUES ($1, $2, $3, $4, 'pending', $5, $6)", spec.job_id, *row)
            await sub.verdict("queued")
            return
        # Held for the batch's end (services/admission/held.py): two statements for the batch's submissions.
        await sub.audited("queued")  # its submissions row is held with the job's
        rows = hold_rows(tx)  # last: nothing after it can fail
        rows.jobs[spec.job_id] = row
        rows.verdicts.append((sub.event.id, spec.job_id, team, tx.now))
