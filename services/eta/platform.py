"""The admission service's ETA: the pure forward simulation (services/core/eta) with the memory a running service
keeps between refreshes (what it learnt of run times and arrivals, what it told each waiting job), behind a lock
because the service replays in a worker thread (or a forked child) while its handlers report starts and ends.

The stack injects it into the admission service (services/stack.py); the simulator measures the same core
(`gpuq simulate --eta`) without this wrapper.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from services.core.eta import (
    DEFAULT_BUDGET,
    Arrival,
    EtaModel,
    EtaRange,
    refresh_due,
    replay_reserved,
    waiting_queues,
)
from services.core.pipeline.predict import JobKey
from shared.domain import JobSpec


class PlatformEta:
    """The admission service's ETA (injected by the stack): `estimate_ranges` with an `EtaModel` that keeps
    learning from the jobs the service sees start and end, and the memory of what it told each job.

    Called with admission's own view: the cluster, the admission state and, for every job holding GPUs, the end
    the scheduler reserves by (started_at + limit); a running job whose spec admission holds is predicted, one
    it does not (another cohort's, when sharded) keeps its reserved end.
    """

    def __init__(self, model: EtaModel | None = None, budget: int | None = DEFAULT_BUDGET):
        self.model = model or EtaModel()
        self.budget = budget  # a refresh's work (services.core.eta.DEFAULT_BUDGET): its cost is bounded
        self._given: dict[str, list[tuple[float, EtaRange]]] = {}  # waiting job -> first ETA and the latest ones
        self._queued: dict[str, tuple[str, float]] = {}  # waiting job -> (queue, submitted at)
        self._preempted: dict[str, float] = {}  # waiting job -> when it was last preempted (its cool-down)
        # The service replays in a worker thread while its handlers report starts and ends: the replay works on a
        # copy of the model taken under this lock, and every change to the memory holds it (never for a replay).
        self._lock = threading.Lock()
        self._all_beyond = False  # the last refresh started no waiting job within the horizon

    def __call__(self, cluster: Any, state: Any, reserved_ends: Mapping[str, float], now: float,
                 ) -> dict[str, EtaRange]:
        """A refresh in one call (the three steps below; the replay on a copy of the model, so a worker thread
        may run it while the handlers report starts and ends)."""
        queued = self.prepare(state, now)
        with self._lock:
            model = copy.deepcopy(self.model)
            preempted = dict(self._preempted)
        etas = replay_reserved(model, cluster, state, reserved_ends, now, preempted, budget=self.budget)
        self.remember(etas, queued, now)
        return etas

    def prepare(self, state: Any, now: float) -> dict[str, tuple[str, float]]:
        """A refresh's first step, in the caller's thread: the arrivals seen so far go into the model; returns
        what `remember` needs of the waiting jobs as they are now."""
        with self._lock:
            self.model.observe_arrivals(state, now)
        return waiting_queues(state)

    def replay_forked(self, cluster: Any, state: Any, reserved_ends: Mapping[str, float], now: float,
                      ) -> tuple[dict[str, EtaRange], list[tuple[str, Arrival]], dict[str, tuple[str, float]]]:
        """A whole refresh in a forked child of the service (shared/forked.py), on its copy-on-write snapshot of
        this object and of the state: the arrivals are found and learnt, the replay run; returns (ETAs, the
        arrivals learnt, what `remember` needs), for the service's process to `learn` and `remember`. Finding the
        arrivals walks every job held and predicts each new one's work: in the service's process it held its
        event loop for a third of a second per refresh with 10,000 waiting."""
        arrivals = self.model.new_arrivals(state, now)
        self.model.arrivals.observe_many(arrivals, now)
        queued = waiting_queues(state)
        return (replay_reserved(self.model, cluster, state, reserved_ends, now, self._preempted, budget=self.budget),
                arrivals, queued)

    def learn(self, arrivals: Iterable[tuple[str, Arrival]], now: float) -> None:
        """Add the arrivals a forked refresh found (`replay_forked`) to the history."""
        with self._lock:
            self.model.arrivals.observe_many(arrivals, now)

    def remember(self, etas: Mapping[str, EtaRange], queued: Mapping[str, tuple[str, float]], now: float) -> None:
        """A refresh's last step: what each waiting job was told, for calibration against its start."""
        with self._lock:
            self._all_beyond = not etas
            self._remember(etas, queued, now)

    def _remember(self, etas: Mapping[str, EtaRange], queued: Mapping[str, tuple[str, float]], now: float) -> None:
        for job_id, eta in etas.items():
            given = self._given.setdefault(job_id, [])
            given.append((now, eta))
            if len(given) > 64:  # the first and enough of the latest to find the one in force halfway
                del given[1:len(given) - 63]
            if job_id in queued:
                self._queued[job_id] = queued[job_id]

    def job_preempted(self, job_id: str, at: float) -> None:
        """The job was preempted at `at` and waits again: its replays give it the cool-down the preemption service
        gives a preemptor that was itself preempted."""
        with self._lock:
            self._preempted[job_id] = at

    def job_started(self, job_id: str, started_at: float) -> None:
        """The job started: its first ETA and the one in force halfway through its wait go to calibration."""
        with self._lock:
            self._preempted.pop(job_id, None)
            given = self._given.pop(job_id, None)
            queued = self._queued.pop(job_id, None)
            if not given or queued is None:
                return
            queue, submitted_at = queued
            halfway = submitted_at + (started_at - submitted_at) / 2
            in_force = [g for g in given if g[0] <= halfway] or given[:1]
            for given_at, eta in ([given[0]] if in_force[-1] is given[0] else [given[0], in_force[-1]]):
                self.model.job_started(queue, given_at, eta, started_at, submitted_at)

    def job_finished(self, spec: JobSpec, ran_s: float | None, ended_at: float | None = None) -> None:
        """The job ended (`ran_s` seconds of run time, None if it never ran; at `ended_at` when known): history
        for the predictor."""
        with self._lock:
            self._given.pop(spec.job_id, None)
            self._queued.pop(spec.job_id, None)
            self._preempted.pop(spec.job_id, None)
            if ran_s is not None:
                self.model.job_finished(spec, ran_s, ended_at)

    def predicted_s(self, spec: JobSpec) -> float:
        """A job's predicted run time (median) from the history this ETA learned: admission's duration-aware
        ordering reads the same predictor, so the run-time history has one owner."""
        with self._lock:
            return self.model.predictor.predict(JobKey.of(spec), float(spec.max_runtime_s)).median_s

    def refresh_due(self, last_refresh: float | None, now: float, changed: bool) -> bool:
        """Whether the service refreshes ETAs now (module-level `refresh_due`, platform time)."""
        return refresh_due(last_refresh, now, changed, all_beyond=self._all_beyond)

    def accuracy(self) -> dict[str, dict[str, float]]:
        """Per queue: the calibration record's accuracy figures (EtaCalibration.accuracy)."""
        with self._lock:
            cal = self.model.calibration
            return {q: cal.accuracy(q) for q in cal.queues()}
