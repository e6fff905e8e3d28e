"""Run-time history for duration-aware ordering (policy.duration_ordering): what admission learns of finished runs
and the predicted GPU-seconds it stores with each waiting job. One owner of the history: the ETA's predictor when
there is an ETA, otherwise admission's own."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import asyncpg

from services.admission.etas import EtaFn
from services.admission.memory import Memory
from services.core.pipeline.predict import DurationPredictor, JobKey
from shared.domain import JobSpec

log = logging.getLogger("gpuq.admission")

# The predictor's history is rebuilt at start from at most this many of the most recently finished runs: it bounds
# start-up work (the predictor keeps the last 200 runs per group, so this covers the busiest 25 groups in full).
HISTORY_REBUILD_LIMIT = 5000
# Ends after which a job ran as long as it needed (or up to its limit): the only run times that are history.
RAN_TO_THE_END = ("Succeeded", "DeadlineExceeded")


class RunHistory:
    def __init__(self, memory: Memory, eta: EtaFn | None):
        self.memory = memory  # its state's configuration says whether duration ordering is on
        self.eta = eta
        self._predictor = DurationPredictor() if eta is None else None

    async def rebuild(self, conn: asyncpg.Connection) -> None:
        """At start only (a reload keeps the history in memory): the run times of the most recent finished jobs,
        oldest first, as `JobLifecycle.finish` recorded them, so predictions survive a restart."""
        rows = await conn.fetch(
            "SELECT spec, ran FROM (SELECT job_id, spec, finished_at, finished_at - started_at AS ran "
            "FROM admission.jobs WHERE status = 'finished' AND started_at IS NOT NULL AND outcome = ANY($1::text[]) "
            "ORDER BY finished_at DESC, job_id DESC LIMIT $2) t ORDER BY finished_at, job_id",
            list(RAN_TO_THE_END), HISTORY_REBUILD_LIMIT)
        for r in rows:
            self.observe(JobSpec.model_validate_json(r["spec"]), max(0.0, r["ran"]))
        if rows:
            log.info("admission: run-time history rebuilt from %d finished jobs", len(rows))

    def observe(self, spec: JobSpec, ran_s: float | None, ended_at: float | None = None) -> None:
        """A job ended (`ran_s`: its run time, None if it never ran or ended early; at `ended_at` when known, which
        makes it cohort evidence for the running jobs of its group): history for predictions."""
        if self.eta is not None:
            self.eta.job_finished(spec, ran_s, ended_at)
        elif self._predictor is not None and ran_s is not None:
            self._predictor.observe(JobKey.of(spec), float(spec.max_runtime_s), max(0.0, ran_s))

    def predicted_gpu_s(self, spec: JobSpec) -> float | None:
        """Duration-aware ordering (policy.duration_ordering): the job's predicted GPU-seconds from its limit and the
        history of similar finished jobs (never its true duration); None when the policy is off."""
        if not self.memory.state.config.policy.duration_ordering:
            return None
        if self.eta is not None:
            seconds = self.eta.predicted_s(spec)
        else:
            assert self._predictor is not None
            seconds = self._predictor.predict(JobKey.of(spec), float(spec.max_runtime_s)).median_s
        return seconds * spec.total_gpus

    def stored(self, row: Mapping[str, object]) -> float | None:
        """A job's stored prediction (admission.jobs.predicted_gpu_s) when duration ordering is on."""
        value = row["predicted_gpu_s"]
        duration_ordering = self.memory.state.config.policy.duration_ordering
        return float(value) if isinstance(value, int | float) and duration_ordering else None
