"""Node pools as flavors (docs/admission.md): which of its queue's `pools` a job may be given, and an admission
restored from a store that kept the spec as submitted. The choice itself is fit.py's `choose_pool`. Pure."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from services.core.admission.model import AdmittedWorkload
from services.core.admission.quota import QueueQuota
from services.core.admission.resources import Signature, pins_pool, pool_signatures, with_pool
from shared.quota_keys import POOL

if TYPE_CHECKING:
    from services.core.admission.entry import Entry

def intern_requests(e: Entry, qq: QueueQuota | None, ids: dict[Signature, int]) -> None:
    """Set `e`'s request id (`sid`) and the node pools admission may give it (`pools`), in its queue's order, each
    with its request on that pool and that request's id: its queue's `spot_pools` only if it is preemptible; none
    when the queue lists no pools or the job selects one itself."""
    e.sid = ids.setdefault(e.sig, len(ids))
    if qq is None or not qq.config.pools:
        e.pools = ()
        return
    spot = () if e.preemptible else qq.config.spot_pools or ()
    e.pools = tuple((pool, sig, ids.setdefault(sig, len(ids)))
                    for pool, sig in pool_signatures(e.workload.spec, qq.config.pools, qq.non_gpu) if pool not in spot)


def with_its_pool(qq: QueueQuota | None, a: AdmittedWorkload) -> AdmittedWorkload:
    """A restored admission whose store kept the spec as submitted: the node pool admission chose is the one of its
    queue's `pools` it was charged (`pool/<name>` in its usage), and its spec selects it again."""
    if a.pool is not None or qq is None or not qq.config.pools or pins_pool(a.spec):
        return a
    charged = [p for p in qq.config.pools if POOL + p in a.usage]
    if len(charged) != 1:
        return a
    return replace(a, spec=with_pool(a.spec, charged[0]), pool=charged[0])
