"""Idle clocks and TTLs of running jobs, and the decisions they make due (see the package's docstring).

A job is idle at an instant when its latest sample of every GPU it was sampled on is below its class's threshold.
Its idle clock starts at the first such sample after a busy one (or after its start); any busy sample stops it and
withdraws a warning. A job whose newest sample is older than `stale_after_s` is not idle: no data is not idleness
(a DCGM exporter that stopped must not end a user's notebook).

Decisions, each made once per idle spell (or once for the TTL):
- WARN when the clock has run `idle_for_s`: the owner hears by webhook and Event that it is reclaimed at `deadline`;
- RECLAIM when `grace_s` has passed since the warning and the job is still idle: `action` requeue or end,
  checkpointed first when it can be (`checkpoint`);
- TTL when the job has run `ttl_s` since it started (whatever its use).

The clocks are the owning service's state to keep across a restart: `changed` says which clocks moved since it last
asked (each with a version that only grows), `clock_doc` what to store of one and `load_clock` takes it back, so that
a restart neither resets the idle time nor forgets a warning (the reclaim stays due when it was).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shared.config import QueuesConfig
from shared.domain import JobKind
from shared.interactive import IdleAction

# A job with no sample for this long is not judged idle (DCGM samples every few seconds to a minute).
STALE_AFTER_S = 300.0


class DecisionKind(StrEnum):
    WARN = "warn"
    RECLAIM = "reclaim"
    TTL = "ttl"


@dataclass(frozen=True)
class RunningJob:
    """What the watch needs of a running job: its kind (its class), owner, start and whether it can checkpoint."""

    job_id: str
    team: str
    kind: JobKind
    started_at: float
    user: str | None = None
    can_checkpoint: bool = False


@dataclass(frozen=True)
class Decision:
    kind: DecisionKind
    job_id: str
    team: str
    user: str | None
    reason: str  # Idle | TtlExpired
    message: str
    action: IdleAction = IdleAction.END  # for RECLAIM and TTL: what to do
    checkpoint: bool = False  # take a checkpoint first
    idle_since: float | None = None
    deadline: float | None = None  # WARN: when it is reclaimed if it stays idle


@dataclass
class _Clock:
    started_at: float
    gpus: dict[str, tuple[float, float]] = field(default_factory=dict)  # gpu key -> (sampled at, utilisation %)
    idle_since: float | None = None
    warned_at: float | None = None
    reclaimed: bool = False
    ended: bool = False
    version: int = 0  # the watch's change count when this clock last changed

    def doc(self) -> dict[str, Any]:
        return {"started_at": self.started_at, "gpus": {g: list(v) for g, v in sorted(self.gpus.items())},
                "idle_since": self.idle_since, "warned_at": self.warned_at, "reclaimed": self.reclaimed,
                "ended": self.ended, "version": self.version}

    @staticmethod
    def of(doc: dict[str, Any]) -> _Clock:
        return _Clock(started_at=float(doc["started_at"]),
                      gpus={str(g): (float(v[0]), float(v[1])) for g, v in (doc.get("gpus") or {}).items()},
                      idle_since=doc.get("idle_since"), warned_at=doc.get("warned_at"),
                      reclaimed=bool(doc.get("reclaimed")), ended=bool(doc.get("ended")),
                      version=int(doc.get("version") or 0))


class IdleWatch:
    def __init__(self, config: QueuesConfig, stale_after_s: float = STALE_AFTER_S):
        self.config = config
        self.stale_after_s = stale_after_s
        self._clocks: dict[str, _Clock] = {}
        self._version = 0
        self._changed: set[str] = set()

    def configure(self, config: QueuesConfig) -> None:
        self.config = config

    def sample(self, job: RunningJob, gpu: str, at: float, utilization_pct: float) -> None:
        """One GPU's utilisation sample of a running job (samples of a GPU older than the latest are ignored; a job
        whose class has no idle reclaim keeps no clock)."""
        policy = self.config.job_class(job.kind).idle
        if policy is None:
            return
        clock = self._clock(job)
        last = clock.gpus.get(gpu)
        if last is not None and at <= last[0]:
            return
        clock.gpus[gpu] = (at, utilization_pct)
        if any(u >= policy.threshold_pct for _, u in clock.gpus.values()):
            clock.idle_since = None
            clock.warned_at = None
        elif clock.idle_since is None:
            clock.idle_since = max(at, job.started_at)
        self._touch(job.job_id, clock)

    def _touch(self, job_id: str, clock: _Clock | None) -> None:
        self._version += 1
        if clock is not None:
            clock.version = self._version
        self._changed.add(job_id)

    def changed(self) -> list[str]:
        """The jobs whose clocks changed (or went) since the last call, by id: what the owner writes now."""
        out, self._changed = sorted(self._changed), set()
        return out

    def unwritten(self, job_ids: list[str]) -> None:
        """Clocks `changed` named that were not written after all: named again by the next call."""
        self._changed.update(job_ids)

    def clock_doc(self, job_id: str) -> dict[str, Any] | None:
        """What to store of a job's clock (JSON-able, with its version), or None: it has none (delete it)."""
        clock = self._clocks.get(job_id)
        return clock.doc() if clock is not None else None

    def load_clock(self, job_id: str, doc: dict[str, Any]) -> None:
        """A clock stored before a restart (`clock_doc`): the job's idle time and warning go on from where they were
        (a clock of an earlier run is replaced when the job's current run is seen)."""
        clock = self._clocks[job_id] = _Clock.of(doc)
        self._version = max(self._version, clock.version)

    def _clock(self, job: RunningJob) -> _Clock:
        """The job's clock for its current run: a run that started later (a requeued job running again) starts anew."""
        clock = self._clocks.get(job.job_id)
        if clock is None or clock.started_at != job.started_at:
            clock = self._clocks[job.job_id] = _Clock(job.started_at)
            self._touch(job.job_id, clock)
        return clock

    def forget(self, job_id: str) -> None:
        """The job stopped running (ended, preempted, requeued): its clock goes; a new run starts a new one."""
        if self._clocks.pop(job_id, None) is not None:
            self._touch(job_id, None)

    def due(self, jobs: list[RunningJob], now: float) -> list[Decision]:
        """The decisions due at `now` for the running `jobs` (clocks of jobs not listed are dropped), by job id."""
        running = {j.job_id for j in jobs}
        for job_id in sorted(set(self._clocks) - running):
            self.forget(job_id)
        out: list[Decision] = []
        for job in sorted(jobs, key=lambda j: j.job_id):
            decision = self._due(job, now)
            if decision is not None:
                out.append(decision)
        return out

    def _due(self, job: RunningJob, now: float) -> Decision | None:
        cls = self.config.job_class(job.kind)
        clock = self._clock(job)
        if clock.ended or clock.reclaimed:
            return None
        if cls.ttl_s is not None and now - job.started_at >= cls.ttl_s:
            clock.ended = True
            self._touch(job.job_id, clock)
            return Decision(DecisionKind.TTL, job.job_id, job.team, job.user, "TtlExpired",
                            f"{job.kind.value} {job.job_id} reached its class's TTL of {cls.ttl_s}s",
                            action=IdleAction.END, checkpoint=job.can_checkpoint)
        policy = cls.idle
        if policy is None or clock.idle_since is None or not clock.gpus:
            return None
        newest = max(at for at, _ in clock.gpus.values())
        if now - newest > self.stale_after_s:
            return None  # no recent data: not idle
        idle_for = now - clock.idle_since
        if clock.warned_at is not None and now - clock.warned_at >= policy.grace_s:
            clock.reclaimed = True
            self._touch(job.job_id, clock)
            return Decision(DecisionKind.RECLAIM, job.job_id, job.team, job.user, "Idle",
                            f"{job.job_id}'s GPUs stayed below {policy.threshold_pct:g}% for {int(idle_for)}s; "
                            f"{'requeued' if policy.action is IdleAction.REQUEUE else 'ended'} by its class's policy",
                            action=policy.action, checkpoint=job.can_checkpoint, idle_since=clock.idle_since)
        if idle_for >= policy.idle_for_s and clock.warned_at is None:
            # the owner always gets the whole grace from the warning, however late the watch looked
            # (with no grace, the reclaim is due at the next look: the owner is always warned first)
            clock.warned_at = now
            self._touch(job.job_id, clock)
            return Decision(DecisionKind.WARN, job.job_id, job.team, job.user, "Idle",
                            f"{job.job_id}'s GPUs have been below {policy.threshold_pct:g}% for {int(idle_for)}s; "
                            f"it is {'requeued' if policy.action is IdleAction.REQUEUE else 'ended'} in "
                            f"{policy.grace_s}s unless they are used",
                            idle_since=clock.idle_since, deadline=now + policy.grace_s)
        return None
