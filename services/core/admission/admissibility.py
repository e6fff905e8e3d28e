"""Whether a job could ever be admitted under a configuration (its static verdict), apart from what else waits
or runs: its queue exists and lets its team submit, its priority class exists, and some flavor option of each pod
set fits the queue's quota with the whole cohort idle (a job that is not preemptible: its nominal quota). The
admission state judges each job with these on submission and on every configuration change. Pure functions.
"""

from __future__ import annotations

from services.core.admission.model import Reason
from services.core.admission.quota import QueueQuota, QuotaBook
from services.core.admission.resources import (
    GPU_MEMORY,
    GPU_SHARE,
    GpuOption,
    PodSetDemand,
    Signature,
    pod_set_options,
    request_signature,
)
from services.core.preemption.model import priority_of
from shared.config import PriorityClass, QueuesConfig
from shared.domain import JobSpec


def priority_class(config: QueuesConfig, spec: JobSpec) -> PriorityClass | None:
    """The job's class as admission and the preemption service read it ("normal", JobSpec's built-in default,
    stands for the configuration's default class when one is set)."""
    klasses = config.priority_class_map
    k = klasses.get(spec.priority_class)
    if k is None and spec.priority_class == "normal" and config.default_priority_class:
        k = klasses.get(config.default_priority_class)
    return k


def preemptible(config: QueuesConfig, spec: JobSpec) -> bool:
    """Whether the preemption service could ever take this job (its class, its spec's override, production)."""
    return priority_of(config, spec)[1]


def flavor_options(book: QuotaBook, qq: QueueQuota, demand: PodSetDemand) -> tuple[GpuOption, ...]:
    """The flavor options of one pod set in `qq`, memoised in the book (per queue and demand)."""
    key = (qq.name, demand)
    opts = book.options_cache.get(key)
    if opts is None:
        opts = pod_set_options(demand, qq.quotas, qq.models)
        book.options_cache[key] = opts
    return opts


def verdict(config: QueuesConfig, book: QuotaBook, spec: JobSpec) -> tuple[str, str] | None:
    """Why a pending job cannot be admitted under the current config (None = it can, some day)."""
    qq = book.queues.get(spec.queue)
    if qq is None:
        return (Reason.QUEUE_DELETED,
                f"queue {spec.queue!r} no longer exists; the job waits until it is configured again")
    if qq.teams and spec.team not in qq.teams:
        return (Reason.INADMISSIBLE_UNAUTHORIZED,
                f"team {spec.team!r} may no longer submit to queue {spec.queue!r}")
    if priority_class(config, spec) is None:
        return (Reason.INADMISSIBLE_UNKNOWN_PRIORITY_CLASS,
                f"priority class {spec.priority_class!r} no longer exists")
    return fit_verdict(book, qq, request_signature(spec, qq.non_gpu), may_borrow=preemptible(config, spec))


def fit_verdict(book: QuotaBook, qq: QueueQuota, sig: Signature, *, may_borrow: bool = True) -> tuple[str, str] | None:
    """No acceptable flavor, or more than the queue could hold even with the whole cohort idle (a job that is
    not preemptible never borrows: more than the queue's nominal quota)."""
    limit_of = book.max_available if may_borrow else book.nominal_of
    taken: dict[str, int] = {}
    for demand in sig:
        options = flavor_options(book, qq, demand)
        if not options:
            amount, models, profile = demand
            asked = ", ".join(models) if models else "any model"
            kind = f" with MIG profile {profile}" if profile else ""
            if profile == GPU_MEMORY:  # no fallback: a share of GPU memory is no number of whole GPUs
                kind = f" GPU memory (a pod set asking only gpu_memory_mib is charged `<model>:{GPU_MEMORY}`)"
            elif profile == GPU_SHARE:
                kind = f" as {GPU_SHARE} or whole GPUs"
            return (Reason.NO_FLAVOR,
                    f"queue {qq.name} has no quota for {asked}{kind} "
                    f"(it has: {', '.join(qq.quotas) or 'nothing'})")
        for _model, r, amount in options:
            if taken.get(r, 0) + amount <= limit_of(qq, r):
                taken[r] = taken.get(r, 0) + amount
                break
        else:
            limits = ", ".join(f"{r} at most {limit_of(qq, r)}" for _m, r, _a in options)
            asks = f"{options[0][2]} {options[0][1]}" if not options[0][0] else f"{options[0][2]}"
            if not may_borrow:
                return (Reason.EXCEEDS_LIMITS,
                        f"asks {asks} but is not preemptible, so it never borrows, and queue {qq.name}'s "
                        f"nominal quota is smaller ({limits})")
            return (Reason.EXCEEDS_LIMITS,
                    f"asks {asks} but queue {qq.name} can never hold that much "
                    f"(nominal + borrowing, with its cohort idle: {limits})")
    return None


def over_quota_messages(book: QuotaBook) -> list[str]:
    """After a configuration change: one message per queue and resource whose admitted jobs now hold more than its
    new quota allows (they stay admitted)."""
    messages = []
    for q in sorted(book.queues):
        qq = book.queues[q]
        for r in sorted(book.usage.get(q, {})):
            u = book.used(q, r)
            limit = book.max_available(qq, r)
            if u > limit:
                messages.append(f"queue {q} now holds {u} {r}, above the {limit} its new quota allows: "
                                "admitted jobs stay admitted, new work waits until usage falls")
    return messages
