"""The telemetry core: folds lifecycle, utilisation and inventory events into the state behind the gauges,
and turns each event into counter increments and histogram observations.

Pure: no I/O, no clock reads (`now` is an argument), deterministic (every iteration that produces output
is sorted). The shell persists the records this core reports as dirty and rebuilds the core from them
after a restart (`load_*`); counters and histograms restart from zero, which Prometheus' `rate()` and
`increase()` handle as a counter reset.
"""

from __future__ import annotations

from datetime import datetime

from services.core.telemetry.gauges import (
    FLOPS_REPORT_MAX_AGE_S,
    MIB,
    STALE_SAMPLE_INTERVALS,
    read_gauges,
    sample_share,
)
from services.core.telemetry.names import JOB_SERIES_CAP
from services.core.telemetry.records import (
    UNKNOWN,
    FlopsRecord,
    JobPhase,
    JobRecord,
    NodeRecord,
    NodeSample,
    SourceRecord,
)
from services.core.telemetry.series import Effects, Gauges, Labels, Observation, labels
from services.core.telemetry.store import TelemetryRecords
from shared.config import ConfigError, parse_queues
from shared.domain import JobSpec, node_shares
from shared.events import (
    ExitReason,
    JobAdmitted,
    JobAttemptFailed,
    JobCancelled,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobFlopsReported,
    JobPending,
    JobPlaced,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobRequeued,
    JobStarted,
    JobSubmitted,
    NodeChanged,
    NodeInventory,
    Payload,
    QueueConfigChanged,
    UtilizationSampled,
    UtilizationSourceChecked,
)
from shared.mfu import mfu

# ETAs are scored for jobs that waited at least this long after their first ETA (the simulator's eta_* figures
# use the same floor): below it a ratio of waits says nothing.
ETA_CHECK_MIN_WAIT_S = 300.0


def _ts(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


_TEAM_FIELDS: dict[type[Payload], frozenset[str]] = {}


def _team_fields(cls: type[Payload]) -> frozenset[str]:
    """Which of the fields `team_of` reads an event type has (looked up once per type, not per event)."""
    found = _TEAM_FIELDS.get(cls)
    if found is None:
        found = _TEAM_FIELDS[cls] = frozenset({"spec", "team", "job_id"} & set(cls.model_fields))
    return found


class TelemetryState(TelemetryRecords):
    """Folds events into the records (`apply`) and reads them as gauges (`gauges`); the records, their
    persistence and the lookups both read are `TelemetryRecords`'."""

    def __init__(self, job_series_cap: int = JOB_SERIES_CAP):
        super().__init__(job_series_cap)
        # The node inventory announcement being received in parts: its id and the nodes its parts named so far.
        self._announcing: tuple[str, set[str]] = ("", set())

    # ------------------------------------------------------------------ lookups the shell needs

    def team_of(self, payload: Payload, scope: str | None = None) -> str | None:
        """The team an event concerns (for webhook routing). A submission's is its publisher's (`scope`, the team of the
        subject it came on; None: an in-process caller vouching for the spec), never the team its body names. The other
        job events are the platform's facts (admission's, the scheduler's, the executors'), or the job's record says."""
        if isinstance(payload, JobSubmitted):
            return payload.spec.team if scope is None else (scope or None)
        fields = _team_fields(type(payload))
        if not fields:  # an event of no job and no team (a utilisation sample): nothing to look up
            return None
        spec = getattr(payload, "spec", None)
        if isinstance(spec, JobSpec):
            return spec.team
        team = getattr(payload, "team", None)
        if isinstance(team, str) and team:
            return team
        job_id = getattr(payload, "job_id", None)
        rec = self.jobs.get(job_id) if isinstance(job_id, str) else None
        return rec.team if rec is not None and rec.team != UNKNOWN else None

    # ------------------------------------------------------------------ events

    def apply(self, payload: Payload, now: float, scope: str | None = None) -> Effects:
        """Fold one event. `scope` is the scope token of the subject it arrived on (the publishing team of a
        team-scoped event: `Payload.scope_of`), which a consumer believes instead of anything in the payload."""
        fx = Effects()
        if isinstance(payload, JobFlopsReported):
            self.flops_reported(payload, now, fx, team=scope)
            return fx
        if isinstance(payload, JobSubmitted):
            self.submitted(payload, now, fx, team=scope)
            return fx
        handler = getattr(self, f"_on_{type(payload).__name__}", None)
        if handler is not None:
            handler(payload, now, fx)
        return fx

    def _record(self, job_id: str, fx: Effects) -> tuple[JobRecord, bool]:
        """The job's record, for a fact about it (a job event other than a submission or a refusal): a record that was
        only a producer's claim so far is admission's job now."""
        rec = self.jobs.get(job_id)
        fresh = rec is None
        if rec is None:
            rec = self.jobs[job_id] = JobRecord(job_id=job_id)
        elif rec.claimed:
            self._confirm(rec, fx)
        fx.jobs.add(job_id)
        return rec, fresh

    @staticmethod
    def _confirm(rec: JobRecord, fx: Effects) -> None:
        """Admission took the submission the record was started from: the job entered its queue (counted once)."""
        rec.claimed = False
        fx.count("gpuq_jobs_submitted", queue=rec.queue, team=rec.team)

    @staticmethod
    def _take_spec(rec: JobRecord, spec: JobSpec) -> None:
        rec.spec = spec
        rec.queue, rec.team, rec.priority_class = spec.queue, spec.team, spec.priority_class
        rec.feature = spec.labels.get("feature", "")

    def submitted(self, p: JobSubmitted, now: float, fx: Effects, *, team: str | None) -> None:
        """A producer's submission, from `team`'s subject (None: an in-process caller vouching for the spec's team).

        A claim until admission decides: it starts a record (`claimed`) only for a job id this core does not know and
        only when it names its publisher's team, and it changes nothing of a job the core knows. Admission refuses
        every second submission of an id (the same team's, or another team's: docs/security.md, "Job identity"), so
        another team resubmitting a job's id neither takes its record (the team its webhooks go to, its metrics'
        labels) nor, through the refusal that follows, erases it (`_on_JobRejected`)."""
        if team is not None and team != p.spec.team:
            return  # names another team than the credential that published it: admission refuses it (Unauthorized)
        if p.spec.job_id in self.jobs:
            return
        rec, _ = self._record(p.spec.job_id, fx)
        self._take_spec(rec, p.spec)
        rec.claimed = True  # counted as submitted when admission takes it (`_confirm`)
        # When the platform got it, not the body's submitted_at: that is the producer's claim, and a
        # backdated one would stretch every wait measured from it (JobAdmitted brings admission's receipt).
        rec.submitted_at = rec.queued_at = now

    def _on_JobQueued(self, p: JobQueued, now: float, fx: Effects) -> None:
        rec = self.jobs.get(p.job_id)
        fresh = rec is None
        if rec is None:
            rec = self.jobs[p.job_id] = JobRecord(job_id=p.job_id, submitted_at=now, queued_at=now)
        if rec.spec is not None and rec.spec.team != p.team:
            rec.spec = None  # not the submission admission queued: its spec says nothing of this job
        rec.queue, rec.team = p.queue, p.team  # admission's facts, whatever the submission said
        rec.position = p.position
        fx.jobs.add(p.job_id)
        if fresh or rec.claimed:
            self._confirm(rec, fx)  # counted under admission's queue and team

    def _on_JobPending(self, p: JobPending, now: float, fx: Effects) -> None:
        rec, fresh = self._record(p.job_id, fx)
        if fresh:
            rec.submitted_at = rec.queued_at = now
        if rec.holds_gpus:
            return  # a late "still pending" after placement: the placement is the newer fact
        rec.queue, rec.stage, rec.reason = p.queue, p.stage, p.reason
        rec.position = p.position_in_queue
        rec.eta = _ts(p.eta)
        if rec.eta is not None and rec.first_eta is None and rec.started_at is None:
            low, high = _ts(p.eta_low), _ts(p.eta_high)
            rec.first_eta = (now, rec.eta, low if low is not None else rec.eta, high if high is not None else rec.eta)

    def _on_JobRejected(self, p: JobRejected, now: float, fx: Effects) -> None:
        """Admission refused a submission of `p.team`'s. That ends the job's record only while the record is that
        submission's claim: a refused second submission of a job's id (a duplicate, or another team's try at it) leaves
        the job as it is."""
        rec = self.jobs.get(p.job_id)
        ends = rec is not None and rec.claimed and (p.team is None or p.team == rec.team)
        if ends:
            del self.jobs[p.job_id]
            fx.jobs.add(p.job_id)
        queue = p.queue or (rec.queue if rec is not None and ends else UNKNOWN)
        fx.count("gpuq_jobs_rejected", queue=queue, reason=p.reason)

    def _on_JobAdmitted(self, p: JobAdmitted, now: float, fx: Effects) -> None:
        rec, _ = self._record(p.job_id, fx)
        self._take_spec(rec, p.spec)
        admitted = _ts(p.admitted_at) or now
        # JobAdmitted is admission's fact, and its submitted_at is when admission received the submission: the job's
        # submit time, and the start of its first wait (a wait after a requeue starts at the requeue).
        received = _ts(p.submitted_at)
        first_wait = rec.queued_at is None or rec.queued_at == rec.submitted_at
        if received is not None:
            rec.submitted_at = received
            if first_wait:
                rec.queued_at = received
        start = rec.queued_at if rec.queued_at is not None else admitted
        if rec.submitted_at is None:
            rec.submitted_at = start
        fx.observe("gpuq_admission_wait_seconds", admitted - start,
                   queue=rec.queue, priority_class=rec.priority_class)
        fx.count("gpuq_jobs_admitted", queue=rec.queue, priority_class=rec.priority_class)
        rec.admitted_at = admitted
        if not rec.holds_gpus:
            rec.phase, rec.stage, rec.reason, rec.eta = JobPhase.PENDING, "placement", "AwaitingPlacement", None

    def _on_JobPlaced(self, p: JobPlaced, now: float, fx: Effects) -> None:
        rec, _ = self._record(p.job_id, fx)
        self._take_spec(rec, p.spec)
        held: set[tuple[str, int]] = set()
        for b in p.bindings:
            held.update((b.node, i) for i in b.gpu_indices)
            if b.mig_slice is not None:
                held.add((b.node, b.mig_slice[0]))
        rec.gpus = sorted(held)
        rec.shares = list(node_shares(p.bindings, p.spec))
        rec.flops = None  # a new placement: earlier throughput reports were for other GPUs
        rec.phase = JobPhase.PLACED
        rec.position = rec.eta = None

    def _on_JobStarted(self, p: JobStarted, now: float, fx: Effects) -> None:
        rec, _ = self._record(p.job_id, fx)
        rec.phase = JobPhase.RUNNING
        rec.started_at = _ts(p.started_at) or now
        self._check_eta(rec, rec.started_at, fx)

    @staticmethod
    def _check_eta(rec: JobRecord, started_at: float, fx: Effects) -> None:
        """ETA accuracy, as the simulator measures it: a job that waited at least ETA_CHECK_MIN_WAIT_S since its
        first ETA counts once; within ±50% of that wait, and whether the start fell in the range it was shown."""
        if rec.first_eta is None:
            return
        given_at, eta, low, high = rec.first_eta
        rec.first_eta = None
        wait = started_at - given_at
        if wait < ETA_CHECK_MIN_WAIT_S:
            return
        fx.count("gpuq_eta_checked", queue=rec.queue)
        if abs(eta - started_at) <= 0.5 * wait:
            fx.count("gpuq_eta_within_50pct", queue=rec.queue)
        if low - 1.0 <= started_at <= high + 1.0:
            fx.count("gpuq_eta_in_range", queue=rec.queue)

    def _finish(self, job_id: str, reason: ExitReason, finished_at: float, fx: Effects) -> None:
        rec = self.jobs.pop(job_id, None)
        fx.jobs.add(job_id)
        if rec is None:
            rec = JobRecord(job_id=job_id)
        fx.count("gpuq_jobs_finished", queue=rec.queue, team=rec.team, exit_reason=str(reason))
        if reason is ExitReason.OOM_KILLED:
            fx.count("gpuq_oom_kills", queue=rec.queue, team=rec.team)
        if rec.submitted_at is not None:
            fx.observe("gpuq_job_completion_seconds", finished_at - rec.submitted_at,
                       queue=rec.queue, priority_class=rec.priority_class, exit_reason=str(reason))

    def _on_JobCompleted(self, p: JobCompleted, now: float, fx: Effects) -> None:
        self._finish(p.job_id, p.exit_reason, _ts(p.finished_at) or now, fx)

    def _on_JobFailed(self, p: JobFailed, now: float, fx: Effects) -> None:
        self._finish(p.job_id, p.exit_reason, _ts(p.finished_at) or now, fx)

    def _on_JobAttemptFailed(self, p: JobAttemptFailed, now: float, fx: Effects) -> None:
        """An attempt failed and is retried: counted, its GPUs are free, and the job waits out its backoff."""
        rec, _ = self._record(p.job_id, fx)
        fx.count("gpuq_job_attempts_failed", queue=rec.queue, team=rec.team, exit_reason=str(p.exit_reason))
        if p.exit_reason is ExitReason.OOM_KILLED:
            fx.count("gpuq_oom_kills", queue=rec.queue, team=rec.team)
        rec.gpus, rec.shares, rec.flops = [], [], None
        rec.phase, rec.stage, rec.reason = JobPhase.PENDING, "admission", "BackoffAfterFailure"
        rec.queued_at = _ts(p.finished_at) or now
        rec.started_at = rec.last_checkpoint_at = rec.admitted_at = None

    def _on_JobCancelled(self, p: JobCancelled, now: float, fx: Effects) -> None:
        self._finish(p.job_id, ExitReason.CANCELLED, _ts(p.cancelled_at) or now, fx)

    def _on_JobCheckpointed(self, p: JobCheckpointed, now: float, fx: Effects) -> None:
        rec = self.jobs.get(p.job_id)
        if rec is not None:
            rec.last_checkpoint_at = max(rec.last_checkpoint_at or 0.0, _ts(p.checkpointed_at) or now)
            fx.jobs.add(p.job_id)

    def _on_JobPreempted(self, p: JobPreempted, now: float, fx: Effects) -> None:
        rec, _ = self._record(p.job_id, fx)
        reason = str(p.reason)
        fx.count("gpuq_preemptions", queue=rec.queue, reason=reason)
        if p.lost_gpu_seconds > 0:
            fx.count("gpuq_preemption_lost_gpu_seconds", p.lost_gpu_seconds, queue=rec.queue, reason=reason)
        rec.gpus, rec.shares, rec.flops = [], [], None
        rec.phase, rec.stage, rec.reason = JobPhase.PENDING, "admission", "Preempted"
        rec.queued_at = _ts(p.preempted_at) or now
        rec.started_at = rec.last_checkpoint_at = rec.admitted_at = None

    def _on_JobRequeued(self, p: JobRequeued, now: float, fx: Effects) -> None:
        rec, fresh = self._record(p.job_id, fx)
        self._take_spec(rec, p.spec)
        if rec.submitted_at is None:
            rec.submitted_at = _ts(p.submitted_at)
        if fresh or rec.holds_gpus:
            rec.gpus, rec.shares, rec.flops, rec.queued_at = [], [], None, now
        rec.phase, rec.stage, rec.reason = JobPhase.PENDING, "admission", "Requeued"

    def _on_UtilizationSampled(self, p: UtilizationSampled, now: float, fx: Effects) -> None:
        node = self.nodes.get(p.node)
        model = p.gpu_model or (node.node.gpu_model if node is not None else UNKNOWN)
        self.samples[p.node] = NodeSample(node=p.node, gpu_model=model, sampled_at=_ts(p.sampled_at) or now,
                                          interval_s=p.interval_s, samples=p.samples)
        fx.samples.add(p.node)
        # One increment per series and counter for the whole node (its GPUs summed in index order), not two per
        # GPU: the metrics layer's cost is per increment, and a node's GPUs mostly share a queue and team.
        per_series: dict[Labels, list[float]] = {}
        for s in sorted(p.samples, key=lambda s: (s.gpu_index, s.gpu_instance or -1)):
            if s.job_id is None:
                continue
            rec = self.jobs.get(s.job_id)
            # labels(feature=…, gpu_model=…, queue=…, team=…), built in that (sorted) order directly
            key: Labels = (("feature", rec.feature if rec else ""), ("gpu_model", model),
                   ("queue", rec.queue if rec else UNKNOWN), ("team", rec.team if rec else UNKNOWN))
            gpu_seconds = p.interval_s * sample_share(s)  # a MIG instance's sample covers its slice
            acc = per_series.get(key)
            if acc is None:
                acc = per_series[key] = [0.0, 0.0]
            acc[0] += gpu_seconds
            acc[1] += gpu_seconds * s.utilization_pct / 100.0
        for key, (allocated, used) in per_series.items():  # in the order each series first appears
            fx.observations.append(Observation("counter", "gpuq_gpu_allocated_seconds", allocated, key))
            fx.observations.append(Observation("counter", "gpuq_gpu_used_seconds", used, key))

    def _on_UtilizationSourceChecked(self, p: UtilizationSourceChecked, now: float, fx: Effects) -> None:
        checked = _ts(p.checked_at) or now
        old = self.sources.get(p.source)
        if old is not None and old.checked_at > checked:
            return  # a late report of an older poll
        last_ok = checked if p.ok else (old.last_ok_at if old is not None else None)
        self.sources[p.source] = SourceRecord(
            source=p.source, endpoint=p.endpoint, ok=p.ok, reason=p.reason, checked_at=checked,
            interval_s=p.interval_s, last_ok_at=last_ok, gpus_exact=p.gpus_exact,
            gpus_approximate=p.gpus_approximate, gpus_unattributed=p.gpus_unattributed)
        fx.sources.add(p.source)
        if not p.ok:
            fx.count("gpuq_utilization_source_failures", source=p.source, reason=p.reason or "Unknown")

    def flops_reported(self, p: JobFlopsReported, now: float, fx: Effects, *, team: str | None) -> None:
        """A job's throughput report, from `team`'s subject: believed only for a running job of that team."""
        rec = self.jobs.get(p.job_id)
        if rec is None or rec.phase is not JobPhase.RUNNING:
            fx.count("gpuq_flops_reports_rejected", reason="NotRunning")
            return
        if team is None or team != rec.team:
            fx.count("gpuq_flops_reports_rejected", reason="WrongTeam")  # another team's credential, or none
            return
        reported = _ts(p.reported_at) or now
        if rec.flops is not None and rec.flops.reported_at > reported:
            return  # an older report arriving late
        ratio = mfu(p.achieved_tflops, self.peak(rec, p.precision))
        if ratio is not None and ratio > 1.0:
            # More than the GPUs' peak: the report (or the configured peak) is wrong; showing it would mislead.
            fx.count("gpuq_flops_reports_rejected", reason="AbovePeak")
            return
        rec.flops = FlopsRecord(tflops=p.achieved_tflops, precision=p.precision, reported_at=reported)
        fx.jobs.add(p.job_id)


    def _on_NodeInventory(self, p: NodeInventory, now: float, fx: Effects) -> None:
        # A part's nodes are as given at once; "the nodes not announced are gone" waits for the last part of the
        # announcement (its parts arrive in order). A part of another announcement starts over.
        if p.part == 1 or p.announcement != self._announcing[0]:
            self._announcing = (p.announcement, set())
        names = self._announcing[1]
        names.update(n.name for n in p.nodes)
        for n in p.nodes:
            self.nodes[n.name] = NodeRecord(node=n)
            fx.nodes.add(n.name)
        if p.last_part:
            for gone in sorted(set(self.nodes) - names):
                del self.nodes[gone]
                fx.nodes.add(gone)
            self._announcing = ("", set())

    def _on_NodeChanged(self, p: NodeChanged, now: float, fx: Effects) -> None:
        fx.nodes.add(p.node.name)
        if p.change == "removed":
            self.nodes.pop(p.node.name, None)
        else:
            self.nodes[p.node.name] = NodeRecord(node=p.node, reason=p.reason, message=p.message)

    def _on_QueueConfigChanged(self, p: QueueConfigChanged, now: float, fx: Effects) -> None:
        try:
            self.set_queues(parse_queues(p.config, "<QueueConfigChanged>"))
        except ConfigError:
            return  # admission rejects invalid configs and says why; telemetry keeps the last good one
        fx.quotas = True

    # ------------------------------------------------------------------ gauges

    def gauges(self, now: float) -> Gauges:
        """Every gauge's current series (see `gauges.read_gauges`)."""
        return read_gauges(self, now)


__all__ = ["ETA_CHECK_MIN_WAIT_S", "FLOPS_REPORT_MAX_AGE_S", "MIB", "STALE_SAMPLE_INTERVALS", "Effects", "Gauges",
           "Labels", "Observation", "TelemetryState", "labels", "sample_share"]
