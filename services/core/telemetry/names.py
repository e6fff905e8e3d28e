"""Every metric the telemetry service exports: name, kind, labels and help text, in one table.

Names follow the Prometheus conventions: `gpuq_` prefix, base units in the name (`_seconds`, `_bytes`,
`_ratio`), counters exported with `_total` (the exporter appends it: the names below omit it for
counters). Long-lived series never carry a job id; the `gpuq_job_*` gauges do, but exist only while that
job is pending or running (like kube-state-metrics' pod series) and are capped (see `JOB_SERIES_CAP`).
"""

from __future__ import annotations

from dataclasses import dataclass

COUNTER, HISTOGRAM, GAUGE = "counter", "histogram", "gauge"


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str
    unit: str
    labels: tuple[str, ...]
    help: str

    @property
    def exported(self) -> str:
        """The name as Prometheus shows it (counters get `_total`)."""
        return self.name + "_total" if self.kind == COUNTER else self.name


# Buckets in seconds: admission waits range from seconds to days; completion times from minutes to weeks.
WAIT_BUCKETS_S = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400, 172800)
JCT_BUCKETS_S = (60, 300, 900, 1800, 3600, 7200, 14400, 28800, 57600, 86400, 172800, 345600, 604800)

JOB_SERIES_CAP = 2000  # per-job gauges exported at most for this many jobs (sorted by queue, job id)

_DEFS = (
    # ---- counters (from events)
    MetricDef("gpuq_jobs_submitted", COUNTER, "1", ("queue", "team"), "Jobs accepted into a queue."),
    MetricDef("gpuq_jobs_rejected", COUNTER, "1", ("queue", "reason"), "Jobs refused by admission."),
    MetricDef("gpuq_jobs_admitted", COUNTER, "1", ("queue", "priority_class"),
              "Admissions (a job requeued after preemption is admitted again)."),
    MetricDef("gpuq_jobs_finished", COUNTER, "1", ("queue", "team", "exit_reason"),
              "Jobs that ended, by exit reason (Succeeded, OOMKilled, Error, Cancelled, ...)."),
    MetricDef("gpuq_oom_kills", COUNTER, "1", ("queue", "team"),
              "Out-of-memory kills: jobs ended by one, and failed attempts that were retried."),
    MetricDef("gpuq_job_attempts_failed", COUNTER, "1", ("queue", "team", "exit_reason"),
              "Failed attempts a job's retry policy retried (the last failure is in gpuq_jobs_finished)."),
    MetricDef("gpuq_eta_checked", COUNTER, "1", ("queue",),
              "Jobs whose first ETA was checked against their start (those that waited 5 minutes or more)."),
    MetricDef("gpuq_eta_within_50pct", COUNTER, "1", ("queue",),
              "Checked jobs whose first ETA was within ±50% of the wait that followed."),
    MetricDef("gpuq_eta_in_range", COUNTER, "1", ("queue",),
              "Checked jobs whose start fell in the p10-p90 range of their first ETA."),
    MetricDef("gpuq_preemptions", COUNTER, "1", ("queue", "reason"), "Jobs preempted, by the victim's queue."),
    MetricDef("gpuq_preemption_lost_gpu_seconds", COUNTER, "s", ("queue", "reason"),
              "GPU-seconds of work lost since the last checkpoint of preempted jobs."),
    MetricDef("gpuq_gpu_allocated_seconds", COUNTER, "s", ("queue", "team", "gpu_model", "feature"),
              "GPU-seconds allocated to jobs (from utilisation samples)."),
    MetricDef("gpuq_gpu_used_seconds", COUNTER, "s", ("queue", "team", "gpu_model", "feature"),
              "GPU-seconds allocated to jobs weighted by sampled utilisation."),
    MetricDef("gpuq_utilization_source_failures", COUNTER, "1", ("source", "reason"),
              "Failed polls of a utilisation source (Unreachable, Timeout, HttpError, QueryError, BadResponse)."),
    MetricDef("gpuq_flops_reports_rejected", COUNTER, "1", ("reason",),
              "JobFlopsReported ignored: the job is not running (NotRunning) or claims more than its peak "
              "(AbovePeak)."),
    # ---- histograms (from events)
    MetricDef("gpuq_admission_wait_seconds", HISTOGRAM, "s", ("queue", "priority_class"),
              "Time from entering the queue (or requeue) to admission."),
    MetricDef("gpuq_job_completion_seconds", HISTOGRAM, "s", ("queue", "priority_class", "exit_reason"),
              "Job completion time: first submission to end."),
    # ---- gauges (from the core's snapshot)
    MetricDef("gpuq_pending_jobs", GAUGE, "1", ("queue", "team", "stage", "reason"),
              "Jobs waiting, by stage (admission, placement) and machine reason."),
    MetricDef("gpuq_running_jobs", GAUGE, "1", ("queue", "team"), "Jobs holding GPUs (placed or running)."),
    MetricDef("gpuq_gpus_allocated", GAUGE, "1", ("queue", "team", "pool", "gpu_model"),
              "Whole GPUs bound to jobs."),
    MetricDef("gpuq_gpus_used", GAUGE, "1", ("queue", "team", "pool", "gpu_model"),
              "GPU-equivalents busy: sum of latest sampled utilisation of jobs' GPUs."),
    MetricDef("gpuq_gpu_memory_used_bytes", GAUGE, "By", ("queue", "team", "pool", "gpu_model"),
              "GPU memory used by jobs (latest samples)."),
    MetricDef("gpuq_gpus_capacity", GAUGE, "1", ("pool", "gpu_model"), "GPUs on ready nodes."),
    MetricDef("gpuq_gpus_free", GAUGE, "1", ("pool", "gpu_model"),
              "GPUs on ready nodes that neither gpuq's jobs nor pods gpuq does not manage hold."),
    MetricDef("gpuq_gpus_held_outside", GAUGE, "1", ("pool", "gpu_model"),
              "GPUs on ready nodes held by pods gpuq does not manage (another scheduler's, a DaemonSet's, an "
              "inference Deployment's): gpuq places nothing there."),
    MetricDef("gpuq_node_gpus_held_outside", GAUGE, "1", ("node", "pool", "gpu_model"),
              "Whole GPUs of a node held by pods gpuq does not manage (nodes holding some)."),
    MetricDef("gpuq_node_mig_slices_held_outside", GAUGE, "1", ("node", "pool", "gpu_model"),
              "MIG slices of a node's profile held by pods gpuq does not manage (nodes holding some)."),
    MetricDef("gpuq_gpus_fragmented", GAUGE, "1", ("pool", "gpu_model"),
              "Free GPUs that no waiting gang can use (0 when no job waits)."),
    MetricDef("gpuq_nodes", GAUGE, "1", ("pool", "gpu_model", "health"), "Nodes by health."),
    MetricDef("gpuq_node_degraded", GAUGE, "1", ("node", "pool", "gpu_model", "reason"),
              "1 while a node is degraded by a GPU fault (reason: XidN or GpuMissing); it takes no new placements."),
    MetricDef("gpuq_quota_guaranteed_gpus", GAUGE, "1", ("gpu_model",),
              "Sum of the queues' nominal (guaranteed) quotas."),
    MetricDef("gpuq_quota_guaranteed", GAUGE, "1", ("resource",),
              "Sum of the queues' nominal quotas beyond GPUs (resource: cpu_milli, memory_mib, pods, pool/<name>)."),
    MetricDef("gpuq_gpu_hourly_cost", GAUGE, "1", ("gpu_model",),
              "Configured price of one GPU-hour (queues.yaml gpu_flavors)."),
    MetricDef("gpuq_checkpoint_age_max_seconds", GAUGE, "s", ("queue",),
              "Oldest time since the last checkpoint (or start) among running checkpointable jobs."),
    MetricDef("gpuq_node_gpu_utilization_ratio", GAUGE, "1", ("node", "gpu", "pool", "gpu_model"),
              "Latest sampled utilisation of one physical GPU, 0..1."),
    MetricDef("gpuq_node_gpu_memory_used_bytes", GAUGE, "By", ("node", "gpu", "pool", "gpu_model"),
              "Latest sampled memory use of one physical GPU."),
    MetricDef("gpuq_node_gpu_allocated", GAUGE, "1", ("node", "gpu", "queue", "team"),
              "1 while the GPU is bound to a job of this queue/team."),
    MetricDef("gpuq_node_gpu_tensor_active_ratio", GAUGE, "1", ("node", "gpu", "pool", "gpu_model"),
              "Latest tensor-pipe activity of one physical GPU, 0..1 (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE)."),
    MetricDef("gpuq_gpus_tensor_active", GAUGE, "1", ("queue", "team", "pool", "gpu_model"),
              "GPU-equivalents of tensor-pipe activity of jobs' GPUs: the MFU proxy (÷ gpuq_gpus_allocated)."),
    MetricDef("gpuq_mfu_ratio", GAUGE, "1", ("queue", "team"),
              "Model FLOPs utilisation of running jobs that report FLOP/s, weighted by their GPUs, 0..1."),
    MetricDef("gpuq_utilization_source_up", GAUGE, "1", ("source",),
              "1 while the utilisation source's latest poll succeeded (and is recent)."),
    MetricDef("gpuq_utilization_source_last_success_timestamp_seconds", GAUGE, "s", ("source",),
              "When the utilisation source last polled successfully (epoch seconds)."),
    MetricDef("gpuq_utilization_source_gpus", GAUGE, "1", ("source", "attribution"),
              "GPUs in the latest poll by attribution: exact (pod labels or GPU placement), approximate "
              "(node-level split), unattributed."),
    MetricDef("gpuq_team_budget_used_ratio", GAUGE, "1", ("team", "period"),
              "GPU-hours a budgeted team used in its current period ÷ its budget (queues.yaml budgets; metering's read "
              "model): GpuqBudgetNearlySpent fires at 0.8."),
    MetricDef("gpuq_team_budget_gpu_hours", GAUGE, "h", ("team", "period", "kind"),
              "A budgeted team's GPU-hours in its current period: kind budget, used, or forecast (at the period's "
              "end, if the rate so far holds)."),
    # ---- short-lived per-job gauges (only while the job waits or runs)
    MetricDef("gpuq_job_pending_info", GAUGE, "1", ("job_id", "queue", "team", "stage", "reason"),
              "1 for each waiting job, with why it waits."),
    MetricDef("gpuq_job_queue_position", GAUGE, "1", ("job_id", "queue", "team"), "Position in its queue."),
    MetricDef("gpuq_job_eta_timestamp_seconds", GAUGE, "s", ("job_id", "queue", "team"),
              "Expected start time (epoch seconds) of a waiting job."),
    MetricDef("gpuq_job_waiting_seconds", GAUGE, "s", ("job_id", "queue", "team"),
              "How long a waiting job has waited so far."),
    MetricDef("gpuq_job_gpus_allocated", GAUGE, "1", ("job_id", "queue", "team"), "GPUs held by a job."),
    MetricDef("gpuq_job_gpu_utilization_ratio", GAUGE, "1", ("job_id", "queue", "team"),
              "Mean latest utilisation over a running job's GPUs, 0..1."),
    MetricDef("gpuq_job_tensor_active_ratio", GAUGE, "1", ("job_id", "queue", "team"),
              "Mean tensor-pipe activity over a running job's GPUs, 0..1: the MFU proxy when it reports no FLOP/s."),
    MetricDef("gpuq_job_mfu_ratio", GAUGE, "1", ("job_id", "queue", "team", "precision"),
              "Model FLOPs utilisation of a running job: reported FLOP/s ÷ peak of its GPUs at that precision."),
)

METRICS: dict[str, MetricDef] = {d.name: d for d in _DEFS}
