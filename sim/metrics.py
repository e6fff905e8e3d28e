"""Metrics of one replay (the JSON of section 6, plus finish-time fairness, fragmentation, events/s).

Definitions (docs/simulator.md repeats them):
- wait = first start - submit. A job that never started (e.g. a pod-fifo deadlock) counts with
  wait = end of replay - submit, a lower bound, so starvation is not hidden; JCT is over completed jobs.
- gpu_utilization = allocated GPU-seconds ÷ (capacity × replay window), the window being the submission
  window [0, last submit]; busy_gpu_utilization counts only GPUs of gangs that run; the difference is idle
  partial-gang GPU time (pods placed, gang incomplete), reported in GPU-hours over the whole replay.
  gpu_utilization_to_makespan uses [0, makespan] instead.
- per_team: gpu_hours = GPU-hours of the team's completed jobs; usage_share = the team's share of GPU-hours
  allocated inside the replay window (where teams compete); quota_share = its queue's nominal ÷ all nominal.
- Themis finish-time fairness ρ = JCT ÷ T_isolated, with T_isolated the job's completion time (from submit)
  if its team ran alone, strict FIFO, on an isolated cluster of 1/N of the capacity (N = teams in the trace);
  a gang larger than the share runs on the whole share, slowed in proportion.
- jain_fairness = Jain's index over teams of x_t = mean over the team's completed jobs of min(1, 1/ρ): 1 when
  every team finishes its jobs no later than on its isolated share; lower when some teams fall behind.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from sim.engine import LOSS_CAUSES, JobRecord, SimResult
from sim.model import Trace, TraceJob


def _r(x: float, nd: int = 3) -> float:
    return round(float(x), nd)


def _pct(values: Sequence[float], q: float) -> float:
    return _r(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else 0.0


def _mean(values: Sequence[float]) -> float:
    return _r(sum(values) / len(values)) if values else 0.0


def jain(xs: Sequence[float]) -> float:
    if not xs:
        return 1.0
    s, s2 = sum(xs), sum(x * x for x in xs)
    return _r(s * s / (len(xs) * s2), 4) if s2 > 0 else 1.0


def isolated_finish_times(trace: Trace) -> dict[str, float]:
    """job_id -> completion time (from submit) alone on a 1/N-share cluster, strict FIFO per team."""
    by_team: dict[str, list[TraceJob]] = {}
    for j in trace.jobs:
        by_team.setdefault(j.team, []).append(j)
    n = max(1, len(by_team))
    share = max(1, trace.capacity_gpus * 1000 // n)  # milli-GPUs
    out: dict[str, float] = {}
    for team in sorted(by_team):
        free = share
        ends: list[tuple[float, int]] = []  # (end, milli)
        clock = 0.0
        for j in by_team[team]:  # already in (submit, id) order
            need = trace.gpu_milli(j)
            run = float(j.duration)
            if need > share:  # too big for the share: takes all of it, slowed in proportion
                run = j.duration * need / share
                need = share
            clock = max(clock, float(j.submit_time))
            while free < need:
                end, milli = heapq.heappop(ends)
                clock = max(clock, end)
                free += milli
            while ends and ends[0][0] <= clock:  # release what ended before this start
                free += heapq.heappop(ends)[1]
            heapq.heappush(ends, (clock + run, need))
            free -= need
            out[j.job_id] = clock + run - j.submit_time
    return out


def _integrals(res: SimResult, until: float) -> tuple[float, float]:
    """(allocated, busy) milli-GPU-seconds over [0, until], from the step function of samples."""
    alloc = busy = 0.0
    s = res.samples
    for a, b in itertools.pairwise(s):
        if a.t >= until:
            break
        dt = min(b.t, until) - a.t
        alloc += a.allocated_milli * dt
        busy += a.busy_milli * dt
    return alloc, busy


def _downsample(points: Sequence[tuple[float, int]], limit: int = 200) -> list[list[float]]:
    step = max(1, len(points) // limit)
    return [[_r(t, 1), v] for t, v in points[::step]]


def end_of(r: JobRecord) -> float:
    """The end of a completed job (the caller has filtered on `r.end is not None`)."""
    assert r.end is not None
    return r.end


def _per_team(trace: Trace, recs: Sequence[JobRecord], considered: Sequence[JobRecord],
              completed: Sequence[JobRecord], rho: Mapping[str, float], end: float, window: float,
              wait_of: Callable[[JobRecord], float]) -> tuple[dict[str, dict[str, Any]], list[float]]:
    """Per team: jobs, waits, GPU-hours, quota and usage shares; and each team's mean 1/rho (for Jain's index)."""
    nominal: dict[str, int] = {q.name: sum(f.nominal for f in q.quotas.values()) for q in trace.queues.queues}
    total_nominal = sum(nominal.values()) or 1
    teams = sorted({r.job.team for r in recs})
    team_hours = {t: 0.0 for t in teams}
    for r in completed:
        team_hours[r.job.team] += trace.gpu_milli(r.job) * r.job.duration / 1000 / 3600
    # Usage share is measured inside the replay window, where teams compete: once every job has finished,
    # delivered GPU-hours are the same under any policy.
    window_hours = {t: 0.0 for t in teams}
    for r in considered:
        if r.start is not None:
            upto = min(r.end if r.end is not None else end, window)
            if upto > r.start:
                window_hours[r.job.team] += trace.gpu_milli(r.job) * (upto - r.start) / 1000 / 3600
    total_window = sum(window_hours.values()) or 1.0
    per_team: dict[str, dict[str, Any]] = {}
    team_x: list[float] = []
    for t in teams:
        rs = [r for r in considered if r.job.team == t]
        w = [wait_of(r) for r in rs]
        queue = rs[0].job.queue if rs else t
        per_team[t] = {
            "jobs": len(rs), "avg_wait_s": _mean(w), "p99_wait_s": _pct(w, 99),
            "gpu_hours": _r(team_hours[t]), "quota_share": _r(nominal.get(queue, 0) / total_nominal, 4),
            "window_gpu_hours": _r(window_hours[t]),
            "usage_share": _r(window_hours[t] / total_window, 4),
        }
        inv = [min(1.0, 1.0 / rho[r.job.job_id]) for r in rs if r.job.job_id in rho]
        if inv:
            team_x.append(sum(inv) / len(inv))
    return per_team, team_x


def _per_class(recs: Sequence[JobRecord], considered: Sequence[JobRecord],
               wait_of: Callable[[JobRecord], float]) -> dict[str, dict[str, Any]]:
    """Per priority class: jobs, how many were preempted, waits."""
    per_class: dict[str, dict[str, Any]] = {}
    for c in sorted({r.job.priority_class for r in recs}):
        rs = [r for r in considered if r.job.priority_class == c]
        w = [wait_of(r) for r in rs]
        per_class[c] = {"jobs": len(rs), "preempted": sum(1 for r in rs if r.preemptions),
                        "avg_wait_s": _mean(w), "p99_wait_s": _pct(w, 99)}
    return per_class


def compute_metrics(res: SimResult, sim_wall_s: float, isolated: dict[str, float] | None = None) -> dict[str, Any]:
    trace = res.trace
    recs = [res.records[j.job_id] for j in trace.jobs]
    end = max(res.end_time, 1.0)
    capacity_milli = trace.capacity_gpus * 1000
    isolated = isolated if isolated is not None else isolated_finish_times(trace)

    def wait_of(r: JobRecord) -> float:
        return (r.start if r.start is not None else end) - r.job.submit_time

    considered = [r for r in recs if r.rejected is None]
    completed = [r for r in considered if r.end is not None]
    waits = [wait_of(r) for r in considered]
    gang_waits = [wait_of(r) for r in considered if trace.gpu_milli(r.job) > 1000]
    jcts = [end_of(r) - r.job.submit_time for r in completed]
    # The replay window is the submission window [first, last submit]: while work arrives the policies
    # compete; the drain after the last arrival (a few very long jobs) is the same for all of them.
    window = max(1.0, float(trace.jobs[-1].submit_time)) if trace.jobs else 1.0
    alloc, busy = _integrals(res, window)
    denom = capacity_milli * window if capacity_milli else 1.0
    alloc_all, busy_all = _integrals(res, end)
    delivered = sum(trace.gpu_milli(r.job) * r.job.duration for r in completed) / 1000 / 3600

    rho = {r.job.job_id: (end_of(r) - r.job.submit_time) / max(1.0, isolated[r.job.job_id])
           for r in completed}

    per_team, team_x = _per_team(trace, recs, considered, completed, rho, end, window, wait_of)
    per_class = _per_class(recs, considered, wait_of)
    frag = [v for _, v in res.fragmentation]
    rhos = sorted(rho.values())
    return {
        "policy": res.policy,
        "jobs": len(recs),
        "completed": len(completed),
        "rejected": len(recs) - len(considered),
        "never_started": sum(1 for r in considered if r.start is None),
        "avg_jct_s": _mean(jcts),
        "p50_jct_s": _pct(jcts, 50),
        "avg_wait_s": _mean(waits),
        "p50_wait_s": _pct(waits, 50),
        "p99_wait_s": _pct(waits, 99),
        # gangs: jobs of more than one whole GPU (what fragmentation keeps waiting; defragmentation's gain)
        "gang_avg_wait_s": _mean(gang_waits),
        "gang_p99_wait_s": _pct(gang_waits, 99),
        "gpu_utilization": _r(alloc / denom, 4),
        "busy_gpu_utilization": _r(busy / denom, 4),
        "makespan_s": _r(end),
        "delivered_gpu_hours": _r(delivered),
        "preemptions": sum(r.preemptions for r in recs),
        "lost_gpu_hours": _r(sum(r.lost_gpu_s for r in recs) / 3600),
        # node failures (only with --node-mtbf-h): failure events, job stops, work lost since checkpoints
        "node_failures": res.node_failures,
        "jobs_stopped_by_node_failures": sum(r.node_failures for r in recs),
        "failure_lost_gpu_hours": _r(sum(r.failure_lost_gpu_s for r in recs) / 3600),
        # work lost per cause (preemptions by their reason, and node failures), and all of it as a share of the
        # delivered GPU-hours
        "lost_gpu_hours_by_cause": _lost_by_cause(recs),
        "lost_work_share": _r((sum(r.lost_gpu_s + r.failure_lost_gpu_s for r in recs) / 3600) / delivered
                              if delivered else 0.0, 5),
        "idle_partial_gang_gpu_hours": _r(max(0.0, alloc_all - busy_all) / 1000 / 3600),
        "replay_window_s": _r(window),
        "gpu_utilization_to_makespan": _r(alloc_all / (capacity_milli * end) if capacity_milli else 0.0, 4),
        "jain_fairness": jain(team_x),
        "themis_rho_worst": _r(rhos[-1] if rhos else 0.0),
        "themis_rho_p99": _pct(rhos, 99),
        "themis_share_rho_above_1": _r(sum(1 for x in rhos if x > 1.0 + 1e-9) / len(rhos), 4) if rhos else 0.0,
        "fragmentation_avg_gpus": _mean(frag),
        "fragmentation_max_gpus": max(frag, default=0),
        "fragmentation_over_time": _downsample(res.fragmentation),
        "per_team": per_team,
        "per_priority_class": per_class,
        "events": res.events,
        "cycles": res.cycles,
        "sim_wall_s": _r(sim_wall_s),
        "events_per_s": _r(res.events / sim_wall_s if sim_wall_s > 0 else 0.0, 1),
    }


def _lost_by_cause(recs: Sequence[JobRecord]) -> dict[str, float]:
    """GPU-hours lost per cause: every preemption cause (sim.engine.LOSS_CAUSES), then node failures."""
    out = dict.fromkeys(LOSS_CAUSES, 0.0)
    for r in recs:
        for cause, lost in r.lost_by_cause.items():
            out[cause] = out.get(cause, 0.0) + lost
    out["node_failure"] = sum(r.failure_lost_gpu_s for r in recs)
    return {cause: _r(lost / 3600) for cause, lost in out.items()}


# Fields that depend on the machine, not on the inputs (excluded when checking determinism).
WALL_CLOCK_FIELDS = ("sim_wall_s", "events_per_s")
