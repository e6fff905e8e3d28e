"""Interactive work's pure core (issue 48, item 1): idle reclaim from measured GPU use and the TTL of a job class.

`IdleWatch` folds GPU-utilisation samples (DCGM, per job and GPU) into each running job's idle clock and, asked at an
instant, decides what is due: warn the owner, reclaim the job (checkpoint first when it can, then requeue or end by
its class), or end it at its TTL. Pure: no clock, no I/O; the caller passes `now` and executes the decisions through
the existing stop and checkpoint-before-preempt paths (docs/admission.md, "Interactive work")."""

from services.core.idle.watch import Decision, DecisionKind, IdleWatch, RunningJob

__all__ = ["Decision", "DecisionKind", "IdleWatch", "RunningJob"]
