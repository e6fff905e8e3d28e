"""One job as the admission core keeps it (pending or admitted): the record AdmissionState (state.py) holds and the
cycle, fit and reclaim modules read. Its own module so that the modules it is handed to need not import the state."""

from __future__ import annotations

from services.core.admission.admissibility import preemptible, verdict
from services.core.admission.model import AdmittedWorkload, Workload
from services.core.admission.ordering import Order, aged_order_time
from services.core.admission.quota import QuotaBook
from services.core.admission.resources import PoolChoice, Signature, gpu_pod_set_names, request_signature
from shared.config import QueuesConfig


class Entry:
    """Internal record of one job (pending or admitted). Mutable and slotted because the cycle touches every
    pending job every cycle; never handed out."""

    __slots__ = ("admitted", "base_at", "gpu_pod_sets", "job_id", "message", "order", "pools", "preemptible",
                 "priority", "queue", "reason", "sid", "sig", "unsaved_runtime_s", "verdict", "workload")

    def __init__(self, workload: Workload, priority: int, preemptible: bool, order_at: float | None = None,
                 non_gpu: tuple[str, ...] = ()):
        spec = workload.spec
        self.workload = workload
        self.job_id = spec.job_id
        self.queue = spec.queue
        self.priority = priority
        # as the preemption service judges it (services/core/preemption/model.py `priority_of`): a job it would never
        # take is never a reclaim candidate here, and never borrows (fit.py `fit_key`: a loan nobody can take
        # back would keep its lender from its own quota)
        self.preemptible = preemptible
        # (-priority, order time, id): the order time is the submit time, or later for longer predicted work
        self.order: Order = (-priority, workload.submitted_at if order_at is None else order_at, spec.job_id)
        self.base_at = self.order[1]  # the order time before aging (ordering.aged_order_time)
        self.sig: Signature = request_signature(spec, non_gpu)  # non_gpu: its queue's (quota.py QueueQuota)
        self.sid = 0  # small int standing for `sig` (cheap memo keys); set by AdmissionState
        # the node pools admission may choose, in its queue's order: (pool, signature on it, its sid); () = none
        self.pools: tuple[PoolChoice, ...] = ()
        self.gpu_pod_sets = gpu_pod_set_names(spec)
        # the work a reclaim could throw away, bounded by the job's limit: 0 when it can checkpoint
        self.unsaved_runtime_s = 0 if spec.checkpoint.supported else spec.max_runtime_s
        self.verdict: tuple[str, str] | None = None  # static inadmissibility under the current config
        self.admitted: AdmittedWorkload | None = None
        # written by the cycle: why it waits (positions are computed when a status is read)
        self.reason = ""
        self.message: object = ""  # str, or the cycle's message object that writes itself when read

    def reprioritise(self, value: int) -> None:
        """Its class's value changed: same order time, new priority."""
        self.priority = value
        self.order = (-value, self.order[1], self.job_id)

    def rejudge(self, config: QueuesConfig, book: QuotaBook) -> str | None:
        """Under a new configuration: its class's value and preemptibility, and (pending) whether the configuration
        can admit it at all. Returns what changed for its owner to read, if anything. An admitted job is charged to
        the new book and stays admitted even if its queue is over quota or gone."""
        k = config.priority_class_map.get(self.workload.spec.priority_class)
        if k is not None and k.value != self.priority:
            self.reprioritise(k.value)
        # a class made (non-)preemptible changes whether the job may borrow and whether it may be reclaimed
        self.preemptible = preemptible(config, self.workload.spec)
        qq = book.queues.get(self.queue)
        self.sig = request_signature(self.workload.spec, qq.non_gpu if qq is not None else ())
        self.pools = ()  # AdmissionState.set_config sets them again (node_pools.intern_requests)
        if self.admitted is not None:
            book.add(self.queue, self.admitted.usage)
            if self.queue not in book.queues:
                return f"admitted job {self.job_id} stays admitted although its queue {self.queue} was deleted"
            return None
        old, self.verdict = self.verdict, verdict(config, book, self.workload.spec)
        if self.verdict is not None and self.verdict != old:
            return f"pending job {self.job_id} is now inadmissible ({self.verdict[0]}): {self.verdict[1]}"
        if self.verdict is None and old is not None:
            return f"pending job {self.job_id} is admissible again"
        return None

    def age(self, now: float, max_age_s: float) -> tuple[bool, bool]:
        """Wait-time aging (ordering.aged_order_time): moves its order time. Returns (moved, done): whether its
        order changed, and whether it waited max_age_s and is keyed by its submit time for good."""
        submitted = self.workload.submitted_at
        at = aged_order_time(submitted, self.base_at, now, max_age_s)
        moved = at != self.order[1]
        if moved:
            self.order = (self.order[0], at, self.job_id)
        return moved, at == submitted

    def starvation_view(self) -> tuple[int, float] | None:
        """(class, submit time) while it pends admissible: what the starvation rule judges (starvation.py)."""
        if self.admitted is not None or self.verdict is not None:
            return None
        return self.priority, self.workload.submitted_at
