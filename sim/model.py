"""What the simulator replays: a trace of jobs plus the cluster and queues it runs against.

Times are integer seconds since the start of the replay window (virtual time); `epoch0` keeps the wall-clock
origin for reports. A `TraceJob` carries the true `duration` (only the engine sees it) and the user's estimate
`max_runtime_s` (what the schedulers see).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.config import QueuesConfig
from shared.domain import CheckpointSpec, JobSpec, NodeSpec, PodSet, TopologyLevel, TopologyRequest


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    submit_time: int  # seconds since the replay origin
    duration: int  # true run time, seconds (never shown to a scheduler)
    team: str
    queue: str
    pods: int = 1
    gpus_per_pod: int = 1
    mig_profile: str | None = None  # fractional GPU as one MIG-like slice (openb)
    gpu_models: tuple[str, ...] = ()  # any-of; empty = any
    priority_class: str = "normal"
    max_runtime_s: int = 86_400  # the user's estimate
    cpu_milli: int = 0  # per pod
    memory_mib: int = 0  # per pod
    preferred_level: TopologyLevel | None = None
    checkpoint_interval_s: int | None = None  # None = the job cannot checkpoint (loses all work on eviction)
    share_milli: int = 0  # > 0: each pod asks this part of one shared GPU, in milli-GPUs (openb's gpu_milli)
    # An elastic job's goodput curve: its throughput with 1, 2, ... pods as a share of its throughput with all of
    # them (the last entry 1.0). Empty: linear (n pods of N do n/N of the work per second), `goodput`.
    goodput: tuple[float, ...] = ()
    min_pods: int | None = None  # elastic: the fewest pods it runs with (PodSet.min_count); None: a fixed gang

    @property
    def gpus(self) -> int:
        """Whole GPUs of the gang (MIG-slice pods and pods sharing a GPU count 0)."""
        return 0 if self.mig_profile or self.share_milli else self.pods * self.gpus_per_pod

    @property
    def slices(self) -> int:
        return self.pods if self.mig_profile else 0

    def spec(self) -> JobSpec:
        return JobSpec(
            job_id=self.job_id,
            team=self.team,
            queue=self.queue,
            priority_class=self.priority_class,
            pod_sets=(
                PodSet(
                    name="main",
                    count=self.pods,
                    gpus_per_pod=1 if self.mig_profile or self.share_milli else self.gpus_per_pod,
                    gpu_fraction=self.share_milli / 1000 if self.share_milli else None,
                    gpu_models=self.gpu_models,
                    mig_profile=self.mig_profile,
                    cpu_milli=self.cpu_milli,
                    memory_mib=self.memory_mib,
                    min_count=self.min_pods,
                ),
            ),
            topology=TopologyRequest(preferred_level=self.preferred_level),
            checkpoint=CheckpointSpec(supported=self.checkpoint_interval_s is not None,
                                      interval_s=self.checkpoint_interval_s),
            max_runtime_s=self.max_runtime_s,
        )


def goodput(job: TraceJob, pods: int, of: int) -> float:
    """The share of its whole-gang throughput an elastic job gets from `pods` of its `of` pods: its own curve
    (`TraceJob.goodput`, by pod count) when it has one that long, else linear (`pods / of`). Never 0."""
    if pods >= of:
        return 1.0
    if len(job.goodput) >= of:
        return max(1e-6, job.goodput[pods - 1])
    return max(1, pods) / of


@dataclass
class Trace:
    """A replayable workload: jobs sorted by (submit_time, job_id), the nodes and the queues."""

    name: str
    jobs: list[TraceJob]
    nodes: list[NodeSpec]
    queues: QueuesConfig
    epoch0: float = 0.0  # wall-clock epoch seconds of virtual time 0
    info: dict[str, object] = field(default_factory=dict)  # what the loader did (dropped rows, scale, ...)

    @property
    def capacity_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def gpu_milli(self, job: TraceJob) -> int:
        """A job's footprint in milli-GPUs: whole GPUs, slices as their fraction of a GPU, or its shares of GPUs."""
        if job.share_milli:
            return job.pods * job.share_milli
        if not job.mig_profile:
            return job.gpus * 1000
        return job.slices * self.slice_milli()

    def slice_milli(self) -> int:
        # Cached per node list (loaders may swap `nodes`): called for every MIG job's footprint.
        cached = self.__dict__.get("_slice_milli")
        if cached is None or cached[0] is not self.nodes:
            per_gpu = max((n.mig.slices_per_gpu for n in self.nodes if n.mig), default=1)
            cached = (self.nodes, 1000 // per_gpu)
            self.__dict__["_slice_milli"] = cached
        return cached[1]

    def offered_load(self) -> float:
        """GPU-seconds asked for ÷ (capacity × span of submissions); 0 when the trace is empty."""
        if not self.jobs or self.capacity_gpus == 0:
            return 0.0
        span = max(1, self.jobs[-1].submit_time - self.jobs[0].submit_time)
        demand = sum(self.gpu_milli(j) * j.duration for j in self.jobs) / 1000
        return demand / (self.capacity_gpus * span)
