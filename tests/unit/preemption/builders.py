"""Test data builders for the preemption core."""

from __future__ import annotations

from services.core.preemption import PRIORITY, Preemptor, RunningJob, priority_of
from services.core.scheduler import ClusterState
from shared.config import QueuesConfig, parse_queues
from shared.domain import JobKind, JobSpec, NodeSpec, PodSet

MODEL = "H100-80GB"


def queues(window: int = 600, a_nominal: int = 8, b_nominal: int = 8, max_loss: int | None = None,
           loss_aware: bool = False, **queue_kw: object) -> QueuesConfig:
    """Queues for the rules under test; the unsaved-work bound is off unless a test sets `max_loss`."""
    return parse_queues({
        "priority_classes": [
            {"name": "production", "value": 1000, "preemptible": False},
            {"name": "high", "value": 500, "preemptible": False},
            {"name": "normal", "value": 100, "preemptible": True},
            {"name": "low", "value": 0, "preemptible": True},
        ],
        "cohorts": [{"name": "research"}],
        "queues": [
            {"name": "team-a", "cohort": "research", "quotas": {MODEL: {"nominal": a_nominal}}, **queue_kw},
            {"name": "team-b", "cohort": "research", "quotas": {MODEL: {"nominal": b_nominal}}, **queue_kw},
        ],
        "policy": {"protection_window_s": window, "checkpoint_grace_s": 300, "max_victim_loss_s": max_loss,
                   "loss_aware_reclaim": loss_aware},
    })


def nodes(count: int = 2, gpus: int = 8) -> list[NodeSpec]:
    return [NodeSpec(name=f"n-{i}", gpus=gpus, gpu_model=MODEL, cpu_milli=96000, memory_mib=1 << 20,
                     rack=f"r-{i // 2}", block="b-0") for i in range(count)]


def spec(job_id: str, queue: str = "team-a", gpus: int = 1, pods: int = 1, klass: str = "low",
         kind: JobKind = JobKind.TRAINING, max_runtime_s: int = 36_000, **kw: object) -> JobSpec:
    return JobSpec(job_id=job_id, team=queue, queue=queue, priority_class=klass, kind=kind,
                   pod_sets=(PodSet(count=pods, gpus_per_pod=gpus, cpu_milli=0, memory_mib=0),),
                   max_runtime_s=max_runtime_s, **kw)


class World:
    """A cluster with running jobs placed by the real placement core, plus their RunningJob views."""

    def __init__(self, config: QueuesConfig, node_count: int = 2, gpus: int = 8):
        self.config = config
        self.cluster = ClusterState.from_nodes(nodes(node_count, gpus))
        self.running: list[RunningJob] = []

    def run(self, s: JobSpec, started_at: float, last_checkpoint_at: float | None = None) -> RunningJob:
        placement = self.cluster.place(s)
        assert not hasattr(placement, "reason"), placement
        self.cluster.commit(placement)
        value, preemptible, production = priority_of(self.config, s)
        job = RunningJob(job_id=s.job_id, queue=s.queue, priority_class=s.priority_class, priority=value,
                         preemptible=preemptible, production=production, kind=s.kind, gpus=float(s.total_gpus),
                         usage={MODEL: s.total_gpus}, started_at=started_at, max_runtime_s=s.max_runtime_s,
                         last_checkpoint_at=last_checkpoint_at, checkpointable=s.checkpoint.supported)
        self.running.append(job)
        return job

    def preemptor(self, s: JobSpec, reason: str = PRIORITY, need: dict[str, int] | None = None) -> Preemptor:
        return Preemptor(job_id=s.job_id, queue=s.queue, priority=priority_of(self.config, s)[0], kind=s.kind,
                         spec=s, reason=reason, need=need or {})
