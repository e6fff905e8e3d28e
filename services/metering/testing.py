"""Builders for metering test data and the benchmark: times in seconds from a fixed Monday 09:00 UTC."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from services.metering.handlers import HANDLERS
from shared.domain import GpuBinding, JobSpec, PodSet
from shared.events import (
    CloudEvent,
    GpuSample,
    JobCancelled,
    JobCompleted,
    JobPlaced,
    JobPreempted,
    JobStarted,
    Payload,
    PreemptionReason,
    QueueConfigChanged,
    UtilizationSampled,
    make_event,
)

T0 = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)
T0_MS = 1_736_154_000_000


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ms(seconds: float) -> int:
    return T0_MS + round(seconds * 1000)


def spec(job_id: str, *, team: str = "team-a", queue: str | None = None, gpus: int = 8, pods: int = 1,
         model: str | None = "H100-80GB", priority_class: str = "normal", labels: dict[str, str] | None = None,
         mig_profile: str | None = None) -> JobSpec:
    pod_set = PodSet(count=pods, gpus_per_pod=1 if mig_profile else gpus // pods,
                     gpu_models=(model,) if model else (), mig_profile=mig_profile)
    return JobSpec(job_id=job_id, team=team, queue=queue or team, priority_class=priority_class,
                   pod_sets=(pod_set,), labels=labels or {})


def placed(job: JobSpec, seconds: float, nodes: list[str], gpus_per_node: int = 8) -> JobPlaced:
    bindings = tuple(GpuBinding(pod=f"main-{i}", node=node, gpu_indices=tuple(range(gpus_per_node)))
                     for i, node in enumerate(nodes))
    return JobPlaced(job_id=job.job_id, spec=job, bindings=bindings, placed_at=at(seconds))


def sampled(node: str, seconds: float, job_id: str | None, utils: list[float], *, power: float = 400.0,
            interval_s: float = 60.0, model: str | None = "H100-80GB") -> UtilizationSampled:
    return UtilizationSampled(
        node=node, gpu_model=model, sampled_at=at(seconds), interval_s=interval_s,
        samples=tuple(GpuSample(job_id=job_id, gpu_index=i, utilization_pct=u, power_w=power)
                      for i, u in enumerate(utils)))


QUEUES_DOC: dict[str, Any] = {
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a"}, {"name": "team-b"}],
    "gpu_flavors": {"H100-80GB": {"cost_per_gpu_hour": 4.0}, "A100-40GB": {"cost_per_gpu_hour": 2.0}},
}


@dataclass
class FakeTx:
    conn: asyncpg.Connection
    now: float
    emitted: list[CloudEvent] = field(default_factory=list)


def event(payload: Payload, seconds: float = 0) -> CloudEvent:
    return make_event(payload, source="test", time=at(seconds))


async def deliver(pool: asyncpg.Pool, events: list[CloudEvent]) -> None:
    """Each event in its own transaction, as the runtime does (without its inbox: we test the ledger's own
    idempotence)."""
    for ev in events:
        payload = ev.payload()
        async with pool.acquire() as conn, conn.transaction():
            await HANDLERS[type(payload)](FakeTx(conn, 0.0), ev, payload)


def scenario() -> list[CloudEvent]:
    """team-a trains on two nodes for an hour at 50%; team-b is preempted (losing 900 GPU-s), resumes
    elsewhere and finishes; team-b's notebook is cancelled before placement."""
    a = spec("a-train", team="team-a", gpus=16, pods=2, labels={"feature": "search", "project": "p1"})
    b = spec("b-train", team="team-b", gpus=8, labels={"feature": "ads"})
    evs = [event(QueueConfigChanged(config=QUEUES_DOC), -60),
           event(placed(a, 0, ["h-0", "h-1"]), 0), event(JobStarted(job_id="a-train", started_at=at(60)), 60),
           event(placed(b, 0, ["h-2"]), 0),
           event(JobPreempted(job_id="b-train", reason=PreemptionReason.PRIORITY, lost_gpu_seconds=900.0,
                              preempted_at=at(1800)), 1800),
           event(placed(b, 2400, ["h-3"]), 2400),
           event(JobCompleted(job_id="b-train", finished_at=at(4200)), 4200),
           event(JobCompleted(job_id="a-train", finished_at=at(3600)), 3600),
           event(JobCancelled(job_id="b-nb", by="alice"), 100)]
    for k in range(1, 61):  # one sample a minute, each covering the minute before it
        for node in ("h-0", "h-1"):
            evs.append(event(sampled(node, k * 60, "a-train", [50.0] * 8, power=400.0), k * 60))
    return evs


