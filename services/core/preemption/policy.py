"""Who may be a victim of whom: the rules of the issue, each returning a machine reason when it says no.

Order of the checks (first failing rule is reported, so the reason a user sees is the most fundamental one):
  1 class      production never; non-preemptible classes never (JobSpec.preemptible overrides the class)
  2 kind       training never preempts inference
  3 queue      same queue: the preemptor queue's `within_queue`; other queue: same cohort tree, the victim's
               queue above its nominal quota on a resource the preemptor needs (a borrower), and the
               preemptor queue's `reclaim_within_cohort`; ReclaimQuota takes from its own queue only when
               admission asked for that part too (`own_need`: preempt in the queue and reclaim together)
  4 priority   strictly lower priority, except `reclaim_within_cohort: Any` which may take any borrower
               (Kueue's reclaimWithinCohort: Any)
  5 window     not younger than `protection_window_s`, not within it of its expected end
               (started_at + max_runtime_s) — Slurm's PreemptExemptTime and KAI's minimum runtime, plus
               the end-of-run protection Kueue lacks
  6 lost work  priority preemption only: not when it would lose more than `max_victim_loss_s` of its run.
               Never for ReclaimQuota of nominal quota: that is a guarantee the bound must not veto (the
               risk is controlled where it is taken, at borrowing time: `max_unsafe_borrow_runtime_s`); a
               ReclaimQuota whose preemptor borrows (`max_victim_priority` set: borrow_within_cohort, fair
               sharing) reclaims no guarantee and keeps the bound
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from shared.config import PreemptionPolicy, QueuesConfig
from shared.domain import JobKind

from .model import RECLAIM, Preemptor, RunningJob, Why


def needed_resources(preemptor: Preemptor) -> tuple[str, ...]:
    """Quota resources the preemptor needs: the request's `need`, else the models it may run on."""
    if preemptor.need:
        return tuple(sorted(preemptor.need))
    return tuple(sorted(preemptor.allowed_models or preemptor.spec.gpu_models))


def is_borrowing(queue: str, resources: Iterable[str], usage: Mapping[str, Mapping[str, int]],
                 config: QueuesConfig) -> bool:
    """The queue uses more than its nominal quota of one of `resources` (any resource when none given)."""
    q = config.queue_map.get(queue)
    used = usage.get(queue, {})
    if q is None:
        return False
    wanted = tuple(resources)
    keys = wanted if wanted else tuple(sorted(used))
    for r in keys:
        for key in sorted(used):
            # a need for a model covers the MIG slices of that model too ("<model>:<profile>")
            if key == r or key.split(":", 1)[0] == r:
                nominal = q.quotas[key].nominal if key in q.quotas else 0
                if used[key] > nominal:
                    return True
    return False


def protection(job: RunningJob, now: float, window_s: int) -> tuple[str, float] | None:
    """(reason, until) while the job is inside its protection window, else None."""
    if window_s <= 0:
        return None
    if now - job.started_at < window_s:
        return Why.JUST_STARTED, job.started_at + window_s
    if job.expected_end - now < window_s:
        return Why.NEAR_END, job.expected_end
    return None


def protection_ends(running: Iterable[RunningJob], rejected: Mapping[str, str], now: float,
                    window_s: int) -> float | None:
    """When the earliest candidate rejected only as just started leaves its protection window (None if none).

    A request that found no victim because its candidates were too young is worth running again then: the
    lender's guarantee is "nominal quota back within the protection window", not "when the borrowers end"."""
    ends = [job.started_at + window_s for job in running
            if rejected.get(job.job_id) == Why.JUST_STARTED and job.started_at + window_s > now]
    return min(ends) if ends else None


def class_verdict(job: RunningJob) -> str | None:
    if job.production:
        return Why.PRODUCTION
    if not job.preemptible:
        return Why.NOT_PREEMPTIBLE
    return None


def victim_verdict(preemptor: Preemptor, job: RunningJob, config: QueuesConfig,
                   usage: Mapping[str, Mapping[str, int]], now: float,
                   borrowing: dict[str, bool] | None = None) -> str | None:
    """None when `job` may be taken for `preemptor` now, else the first rule that forbids it. `borrowing`: a
    dict the caller keeps for one (preemptor, usage) across many jobs, queue -> is it borrowing (filled here;
    the answer depends on nothing else, and judging every running job asked it once per job)."""
    if job.job_id == preemptor.job_id:
        return Why.SELF
    verdict = class_verdict(job)
    if verdict is not None:
        return verdict
    if preemptor.kind is JobKind.TRAINING and job.kind is JobKind.INFERENCE:
        return Why.INFERENCE
    pq = config.queue_map.get(preemptor.queue)
    if pq is None:
        return Why.OTHER_COHORT
    any_priority = False
    if job.queue == preemptor.queue:
        if preemptor.reason == RECLAIM and not preemptor.own_need:
            return Why.RECLAIM_SAME_QUEUE
        if pq.preemption.within_queue is PreemptionPolicy.NEVER:
            return Why.WITHIN_QUEUE_NEVER
    else:
        vq = config.queue_map.get(job.queue)
        # same cohort tree (a flat cohort is its own root): quota flows, and is reclaimed, across the tree
        if pq.cohort is None or vq is None or config.cohort_root(vq.cohort) != config.cohort_root(pq.cohort):
            return Why.OTHER_COHORT
        if pq.preemption.reclaim_within_cohort is PreemptionPolicy.NEVER:
            return Why.RECLAIM_NEVER
        borrows = borrowing.get(job.queue) if borrowing is not None else None
        if borrows is None:
            borrows = is_borrowing(job.queue, needed_resources(preemptor), usage, config)
            if borrowing is not None:
                borrowing[job.queue] = borrows
        if not borrows:
            return Why.NOT_BORROWING
        any_priority = pq.preemption.reclaim_within_cohort is PreemptionPolicy.ANY
        if preemptor.max_victim_priority is not None and job.priority > preemptor.max_victim_priority:
            return Why.NOT_LOWER_PRIORITY  # borrow_within_cohort takes only borrowers below its threshold
    if not any_priority and job.priority >= preemptor.priority:
        return Why.NOT_LOWER_PRIORITY
    window = protection(job, now, config.policy.protection_window_s)
    if window is not None:
        return window[0]
    # a preemptor that borrows (borrow_within_cohort, fair sharing: max_victim_priority set) reclaims no
    # guarantee, so the bound holds for its victims as for a priority preemption's
    reclaims_nominal = preemptor.reason == RECLAIM and preemptor.max_victim_priority is None
    if (not reclaims_nominal or job.queue == preemptor.queue) and exceeds_loss_bound(job, config, now):
        # Preempting it would throw away more than `max_victim_loss_s` of its run (it cannot checkpoint, or
        # its last checkpoint is old): a priority preemptor waits for capacity instead. A reclaim of nominal
        # quota is never vetoed by the bound (the lender was promised its quota back); there the lost work
        # only steers which borrower is taken (selection prefers the least lost work).
        return Why.TOO_MUCH_LOST_WORK
    return None


def victim_verdicts(preemptor: Preemptor, jobs: Iterable[RunningJob], config: QueuesConfig,
                    usage: Mapping[str, Mapping[str, int]], now: float, busy: Collection[str] = ()
                    ) -> tuple[dict[str, str], list[RunningJob]]:
    """`victim_verdict` of every job, in order: (job id -> the reason it may not be taken, the jobs that may).
    A job in `busy` is `Why.BEING_PREEMPTED`. Victim selection judges every running job for every request, so
    what depends only on the preemptor, or on it and the job's queue (rule 3: the queue rules, whether the queue
    borrows), is worked out once per queue here; the rules and their order are `victim_verdict`'s."""
    rejected: dict[str, str] = {}
    eligible: list[RunningJob] = []
    pid, priority, cap = preemptor.job_id, preemptor.priority, preemptor.max_victim_priority
    training = preemptor.kind is JobKind.TRAINING
    inference = JobKind.INFERENCE
    window_s = config.policy.protection_window_s
    bound = config.policy.max_victim_loss_s
    # a preemptor that borrows reclaims no guarantee: the loss bound holds for other queues' victims too
    reclaims_nominal = preemptor.reason == RECLAIM and preemptor.max_victim_priority is None
    # queue -> (its rule-3 verdict, or None with: any priority, the borrow_within_cohort cap applies,
    # the loss bound applies)
    gates: dict[str, tuple[str | None, bool, bool, bool]] = {}
    resources = needed_resources(preemptor)
    for job in jobs:
        jid = job.job_id
        if jid in busy:
            rejected[jid] = Why.BEING_PREEMPTED
            continue
        if jid == pid:
            rejected[jid] = Why.SELF
            continue
        if job.production:
            rejected[jid] = Why.PRODUCTION
            continue
        if not job.preemptible:
            rejected[jid] = Why.NOT_PREEMPTIBLE
            continue
        if training and job.kind is inference:
            rejected[jid] = Why.INFERENCE
            continue
        gate = gates.get(job.queue)
        if gate is None:
            gate = gates[job.queue] = _queue_gate(preemptor, job.queue, config, usage, resources, reclaims_nominal)
        why, any_priority, capped, loss_applies = gate
        if why is not None:
            rejected[jid] = why
            continue
        if capped and cap is not None and job.priority > cap:
            rejected[jid] = Why.NOT_LOWER_PRIORITY
            continue
        if not any_priority and job.priority >= priority:
            rejected[jid] = Why.NOT_LOWER_PRIORITY
            continue
        if window_s > 0:  # `protection`
            if now - job.started_at < window_s:
                rejected[jid] = Why.JUST_STARTED
                continue
            if job.started_at + job.max_runtime_s - now < window_s:
                rejected[jid] = Why.NEAR_END
                continue
        if (loss_applies and bound is not None and job.gpus > 0
                and job.lost_gpu_seconds(now) / job.gpus > bound):  # `exceeds_loss_bound`
            rejected[jid] = Why.TOO_MUCH_LOST_WORK
            continue
        eligible.append(job)
    return rejected, eligible


def _queue_gate(preemptor: Preemptor, queue: str, config: QueuesConfig, usage: Mapping[str, Mapping[str, int]],
                resources: tuple[str, ...], reclaims_nominal: bool) -> tuple[str | None, bool, bool, bool]:
    """Rule 3 of `victim_verdict` for a job of `queue` (rules 1-2 passed; `resources`: the preemptor's
    `needed_resources`): (the verdict, or None and: any priority may be taken, the borrow_within_cohort cap
    applies, the loss bound applies)."""
    pq = config.queue_map.get(preemptor.queue)
    if pq is None:
        return Why.OTHER_COHORT, False, False, False
    if queue == preemptor.queue:
        if preemptor.reason == RECLAIM and not preemptor.own_need:
            return Why.RECLAIM_SAME_QUEUE, False, False, False
        if pq.preemption.within_queue is PreemptionPolicy.NEVER:
            return Why.WITHIN_QUEUE_NEVER, False, False, False
        return None, False, False, True
    vq = config.queue_map.get(queue)
    if pq.cohort is None or vq is None or config.cohort_root(vq.cohort) != config.cohort_root(pq.cohort):
        return Why.OTHER_COHORT, False, False, False
    if pq.preemption.reclaim_within_cohort is PreemptionPolicy.NEVER:
        return Why.RECLAIM_NEVER, False, False, False
    if not is_borrowing(queue, resources, usage, config):
        return Why.NOT_BORROWING, False, False, False
    return None, pq.preemption.reclaim_within_cohort is PreemptionPolicy.ANY, True, not reclaims_nominal


def exceeds_loss_bound(job: RunningJob, config: QueuesConfig, now: float) -> bool:
    """Preempting `job` now would lose more than `policy.max_victim_loss_s` seconds of its run."""
    bound = config.policy.max_victim_loss_s
    return bound is not None and job.gpus > 0 and job.lost_gpu_seconds(now) / job.gpus > bound
