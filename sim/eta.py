"""Expected start times (ETA) by forward simulation with the production pipeline core.

`estimate_starts` copies the admission and cluster snapshots, then replays the future the schedulers
believe in: running jobs end at their expected end (started_at + max_runtime_s), and after each end the
pipeline's cycle (`services.pipeline.core.cycle`: admission, then placement in the pipeline's order) runs as
in production. Nothing new arrives (an ETA is "if nothing with
higher priority shows up"). Pure: no I/O, no clock, the states passed in are never mutated.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

DEFAULT_HORIZON_S = 30 * 86_400.0
MIN_REMAINING_S = 60.0  # an overrunning job (past its estimate) is assumed to end this soon


def estimate_starts(cluster: Any, admission: Any, running: Mapping[str, float], now: float, *,
                    horizon_s: float = DEFAULT_HORIZON_S, max_cycles: int = 10_000,
                    backfill: bool = True) -> dict[str, float]:
    """{job_id: planned start (same clock as `now`, e.g. epoch seconds)} for every admitted-but-unplaced and
    pending job that would start within `horizon_s`; jobs that would not are left out.

    cluster:   services.scheduler.core.ClusterState (running jobs' allocations committed)
    admission: services.admission.core.AdmissionState (pending + admitted workloads)
    running:   job_id -> expected end (started_at + max_runtime_s) of every job holding GPUs
    """
    from services.pipeline.core import cycle, waiting_job
    from services.scheduler.core import RunningJob

    cl = cluster.copy()
    adm = admission.copy()
    placed_now = set(cl.allocations())
    ends: list[tuple[float, str]] = sorted((max(end, now + MIN_REMAINING_S if end <= now else end), job_id)
                                           for job_id, end in running.items())
    heapq.heapify(ends)
    expected = dict((j, e) for e, j in ends)
    # Admitted but not yet placed: the scheduler's pending list (the pipeline orders it).
    waiting = {job_id: waiting_job(adm.config, a) for job_id, a in sorted(adm.admitted.items())
               if job_id not in placed_now and job_id not in running}
    starts: dict[str, float] = {}
    t = now
    for _ in range(max_cycles):
        if waiting or adm.pending:
            out = cycle(adm, cl, waiting, [RunningJob(job_id=j, expected_end=e) for j, e in sorted(expected.items())],
                        t, backfill=backfill, run_admission=bool(adm.pending))
            for w in out.admitted:
                waiting[w.job_id] = w
            for p in out.placement.result.placed:
                w = waiting.pop(p.job_id)
                starts[p.job_id] = t
                end = t + w.spec.max_runtime_s
                expected[p.job_id] = end
                heapq.heappush(ends, (end, p.job_id))
        if not waiting and not adm.pending:
            break
        if not ends or ends[0][0] > now + horizon_s:
            break
        t = ends[0][0]
        while ends and ends[0][0] == t:  # every job ending at this instant, then one cycle
            _, job_id = heapq.heappop(ends)
            expected.pop(job_id, None)
            cl.release(job_id)
            adm.finish(job_id)
    return dict(sorted(starts.items()))
