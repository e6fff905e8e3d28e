"""ETA accuracy in the simulator, measured with the production ETA code (sim/eta.py).

`EtaTracked` wraps a `gpuq` policy: after each cycle in which something changed (a job arrived and waits, a job
ended or started, one was preempted) or `refresh_s` of virtual time passed, it asks `estimate_ranges` for the
ETAs of every waiting job, exactly as the admission service does, and keeps what each job was told and when. It
feeds the ETA's model what the platform would learn: a job's run time when it ends (never a duration before),
and each first ETA against the job's actual start (calibration). The engine alone knows true durations.

`eta_metrics` scores, for jobs that waited at least `min_wait_s`, the first ETA (given at submission) and the
ETA in force halfway through the wait (`_mid`); errors are relative to the wait still ahead when the ETA was
given (at submission: the whole wait). A job that waited but was never given an ETA (none within the horizon)
counts as a miss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.core.eta import ETA_REFRESH_S, EtaModel, EtaRange, RunningView, estimate_ranges, refresh_due
from sim.engine import CycleOutput, SimResult
from sim.model import Trace, TraceJob

MIN_WAIT_S = 300.0


@dataclass
class EtaLog:
    """Every ETA a job was given while it waited: (given at, range), in time order."""

    submitted_at: float
    given: list[tuple[float, EtaRange]] = field(default_factory=list)
    started_at: float | None = None


class EtaTracked:
    """A policy wrapper that gives ETAs to waiting jobs the way the admission service does (see module doc)."""

    def __init__(self, inner: Any, model: EtaModel | None = None, refresh_s: float = ETA_REFRESH_S):
        self.inner = inner
        self.name = inner.name
        self.model = model or EtaModel()
        self.refresh_s = refresh_s
        self.logs: dict[str, EtaLog] = {}
        self._run_s: dict[str, float] = {}  # run time so far of jobs that were stopped and wait again
        self._started: dict[str, float] = {}  # running job -> its last start
        self._preempted: dict[str, float] = {}  # job stopped and waiting again -> when (its cool-down)
        self._changed = False
        self._last_refresh: float | None = None
        self.refreshes = 0
        self._all_beyond = False  # the last refresh gave no waiting job an ETA (all beyond the horizon)

    # -- Policy protocol, delegated
    def setup(self, trace: Trace) -> None:
        self.inner.setup(trace)

    def on_arrival(self, job: TraceJob, now: float) -> str | None:
        reason: str | None = self.inner.on_arrival(job, now)
        if reason is None:
            self.logs[job.job_id] = EtaLog(submitted_at=now)
            self._changed = True
        return reason

    def on_completion(self, job_id: str, now: float) -> None:
        spec = self.inner.running[job_id].spec if job_id in self.inner.running else None
        self.inner.on_completion(job_id, now)
        start = self._started.pop(job_id, None)
        if spec is not None and start is not None:
            self.model.job_finished(spec, self._run_s.pop(job_id, 0.0) + now - start, ended_at=now)
        self._changed = True

    def on_node_down(self, node: str, now: float) -> list[str]:
        killed: list[str] = self.inner.on_node_down(node, now)
        for job_id in killed:
            self._stopped(job_id, now, preempted=False)  # a node failure: no preemption cool-down
        self._changed = self._changed or bool(killed)
        return killed

    def on_node_up(self, node: str, now: float) -> None:
        self.inner.on_node_up(node, now)
        self._changed = True

    def allocated_milli(self) -> int:
        return int(self.inner.allocated_milli())

    def fragmentation(self) -> int:
        return int(self.inner.fragmentation())

    def cycle(self, now: float) -> CycleOutput:
        out: CycleOutput = self.inner.cycle(now)
        for job_id in out.started:
            self._started[job_id] = now
            self._preempted.pop(job_id, None)
            log = self.logs.get(job_id)
            if log is not None and log.started_at is None:
                log.started_at = now
                # calibration: the ETA given at submission and the one in force halfway, against the start
                queue = self.inner.submitted[job_id][0].queue
                for given_at, eta in first_and_mid(log, now):
                    self.model.job_started(queue, given_at, eta, now, log.submitted_at)
        for p in out.preempted:
            self._stopped(p.job_id, now)
        self._changed = self._changed or bool(out.started or out.preempted)
        waiting = len(self.inner.submitted) > len(self.inner.running)
        if waiting and refresh_due(self._last_refresh, now, self._changed, self.refresh_s,
                                   all_beyond=self._all_beyond):
            self._refresh(now)
            self._changed = False
        return out

    def _stopped(self, job_id: str, now: float, preempted: bool = True) -> None:
        start = self._started.pop(job_id, None)
        if start is not None:
            self._run_s[job_id] = self._run_s.get(job_id, 0.0) + now - start
            if preempted:
                self._preempted[job_id] = now

    def _refresh(self, now: float) -> None:
        inner = self.inner
        self.model.observe_arrivals(inner.adm, now)
        running = {j: RunningView(info.spec, info.started_at) for j, info in sorted(inner.running.items())}
        etas = estimate_ranges(inner.cluster, inner.adm, running, now, self.model, backfill=inner.backfill,
                               preempted_at=self._preempted)
        for job_id, eta in etas.items():
            log = self.logs.get(job_id)
            if log is not None and log.started_at is None:
                log.given.append((now, eta))
        self._last_refresh = now
        self._all_beyond = not etas
        self.refreshes += 1


def first_and_mid(log: EtaLog, start: float) -> list[tuple[float, EtaRange]]:
    """The ETA given first and the one in force halfway through the wait (one entry when they are the same)."""
    if not log.given:
        return []
    halfway = log.submitted_at + (start - log.submitted_at) / 2
    in_force = [g for g in log.given if g[0] <= halfway] or log.given[:1]
    return [log.given[0]] if in_force[-1] is log.given[0] else [log.given[0], in_force[-1]]


def _score(points: list[tuple[float, float, EtaRange | None, float]], suffix: str) -> dict[str, float]:
    """points: (given_at, actual start, eta or None, submitted_at)."""
    n = len(points)
    out: dict[str, float] = {f"eta_jobs{suffix}": n}
    if not n:
        return out
    errs, signed, covered = [], [], 0
    for given_at, start, eta, _ in points:
        ahead = start - given_at
        if eta is None:
            errs.append(float("inf"))
            continue
        e = (eta.start - start) / ahead
        errs.append(abs(e))
        signed.append(e)
        covered += eta.low - 1.0 <= start <= eta.high + 1.0
    arr = np.asarray(errs)
    out.update({
        f"eta_abs_error_p50_frac{suffix}": round(float(np.median(arr)), 3),
        f"eta_within_20pct{suffix}": round(float(np.mean(arr <= 0.2)), 3),
        f"eta_within_50pct{suffix}": round(float(np.mean(arr <= 0.5)), 3),
        f"eta_interval_coverage{suffix}": round(covered / n, 3),
        f"eta_bias_p50_frac{suffix}": round(float(np.median(signed)), 3) if signed else 0.0,
    })
    return out


def eta_metrics(tracked: EtaTracked, result: SimResult, min_wait_s: float = MIN_WAIT_S) -> dict[str, Any]:
    """The ETA accuracy figures of one replay (see the module doc); `eta_refreshes` counts the replays run."""
    first: list[tuple[float, float, EtaRange | None, float]] = []
    mid: list[tuple[float, float, EtaRange | None, float]] = []
    for job_id, rec in sorted(result.records.items()):
        log = tracked.logs.get(job_id)
        if rec.start is None or log is None or rec.start - log.submitted_at < min_wait_s:
            continue
        start = rec.start
        if not log.given:
            first.append((log.submitted_at, start, None, log.submitted_at))
            mid.append((log.submitted_at, start, None, log.submitted_at))
            continue
        given = first_and_mid(log, start)
        first.append((given[0][0], start, given[0][1], log.submitted_at))
        mid.append((given[-1][0], start, given[-1][1], log.submitted_at))
    return {**_score(first, ""), **_score(mid, "_mid"), "eta_refreshes": tracked.refreshes}
