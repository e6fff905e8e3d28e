"""The simulator's incremental bookkeeping decides exactly what recomputing everything decides.

A replay's decisions (every cycle's starts with their placements, preemptions with their lost work,
rejections, wake-ups, and every job's record) are hashed; the same slice replayed with the scheduler's state
memory switched off (`ClusterIndex.state_memo` always missing) must give the same hash. The preemption hook's
incrementally kept view of the running jobs (and their usage per queue) is compared with one built from scratch
at every call, and the policy's lowest running preemptible priority and sorted timeline of expected ends with a
scan after every cycle."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from services.core.pipeline import VictimChooser as SimPreemption
from services.core.preemption import RunningJob, priority_of, usage_by_queue
from services.core.scheduler.index import MISSING, ClusterIndex
from sim.engine import CycleOutput, Engine
from sim.model import Trace, TraceJob
from sim.policies.gpuq import GpuqPolicy
from sim.run import TraceOptions, load_trace, make_policy

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"


def decisions(trace: Trace, checks: list[str] | None = None) -> str:
    """A hash of every decision of a `gpuq` replay of `trace`. `checks` collects broken bookkeeping."""
    policy = make_policy("gpuq")
    assert isinstance(policy, GpuqPolicy)
    h = hashlib.sha256()
    cycle, arrival = policy.cycle, policy.on_arrival

    def hashed_cycle(now: float) -> CycleOutput:
        out = cycle(now)
        for job_id in out.started:
            placement = policy.cluster.placement_of(job_id)
            h.update(repr((now, "start", job_id, placement.bindings if placement else None)).encode())
        for p in out.preempted:
            h.update(repr((now, "preempt", p.job_id, round(p.lost_gpu_s, 6), p.reason)).encode())
        h.update(repr((now, sorted(out.rejected.items()), out.wake_at)).encode())
        if checks is not None:
            scan = min((p for p, ok in policy._running_class.values() if ok), default=None)
            kept = min(policy._preemptible_running) if policy._preemptible_running else None
            if scan != kept:
                checks.append(f"t={now}: lowest preemptible priority {kept}, a scan says {scan}")
            if policy._timeline != sorted((r.expected_end, r.job_id) for r in policy._running_jobs.values()):
                checks.append(f"t={now}: the kept timeline is not the running jobs' sorted expected ends")
        return out

    def hashed_arrival(job: TraceJob, now: float) -> str | None:
        reason = arrival(job, now)
        h.update(repr((now, "arrival", job.job_id, reason)).encode())
        return reason

    policy.cycle, policy.on_arrival = hashed_cycle, hashed_arrival  # type: ignore[method-assign]
    result = Engine(trace, policy).run()
    for job_id, r in sorted(result.records.items()):
        h.update(repr((job_id, r.start, r.end, r.rejected, r.preemptions, round(r.lost_gpu_s, 6))).encode())
    return h.hexdigest()


def _view_from_scratch(hook: SimPreemption, ctx: Any) -> list[RunningJob]:
    """Every running job's view built anew, its last periodic checkpoint computed at `ctx.now`."""
    out = []
    for job_id in sorted(ctx.running):
        info = ctx.running[job_id]
        spec = info.spec
        interval = spec.checkpoint.interval_s
        last = info.started_at + ((ctx.now - info.started_at) // interval) * interval if interval else None
        value, preemptible, production = priority_of(hook.config, spec)
        model = spec.gpu_models[0] if spec.gpu_models else "gpu"
        out.append(RunningJob(job_id=job_id, queue=spec.queue, priority_class=spec.priority_class, priority=value,
                              preemptible=preemptible, production=production, kind=spec.kind,
                              gpus=float(spec.total_gpus or 1),
                              usage={model: spec.total_gpus} if spec.total_gpus else {},
                              started_at=info.started_at, max_runtime_s=spec.max_runtime_s,
                              last_checkpoint_at=last, checkpointable=spec.checkpoint.supported,
                              checkpoint_cost_s=hook.checkpoint_write_s if hook.checkpointing else None))
    return out


@pytest.mark.parametrize("opts", [
    # a contended Philly slice (arrivals compressed 3x on a twentieth of the cluster): reservations, backfill,
    # reclaims and priority preemptions
    TraceOptions(trace=TRACES / "philly.csv", arrival_scale=3.0, cluster_scale=0.05),
    # the openb slice: heterogeneous models, fractional GPUs (slices), CPU/memory
    TraceOptions(trace=TRACES / "openb_pod_list_gpuspec33.csv"),
], ids=["philly", "openb"])
def test_replay_with_memory_decides_what_replay_without_it_decides(opts: TraceOptions,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    checks: list[str] = []
    kept_view = SimPreemption._running

    def checked_view(self: SimPreemption, ctx: Any) -> list[RunningJob]:
        # the incrementally kept view of the running jobs against one built from scratch
        got = kept_view(self, ctx)
        if got != _view_from_scratch(self, ctx):
            checks.append(f"t={ctx.now}: the preemption hook's view of the running jobs differs from a rebuild")
        if self._usage != usage_by_queue(got):
            checks.append(f"t={ctx.now}: the hook's usage per queue differs from the running jobs' usage")
        return got

    monkeypatch.setattr(SimPreemption, "_running", checked_view)
    remembered = decisions(load_trace(opts), checks)
    assert not checks, checks[:5]
    monkeypatch.setattr(SimPreemption, "_running", kept_view)
    monkeypatch.setattr(ClusterIndex, "state_memo", lambda self, key: MISSING)
    assert decisions(load_trace(opts)) == remembered
