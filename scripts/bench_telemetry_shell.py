"""CPU per event of telemetry's shell (services/telemetry/app.py): `on_event` and the batch-end write, with a
connection stand-in that does no I/O, in batches of 32 as the consumer pulls them. A burst's job events (every
job's submission, then every job's pending, admitted, placed, started) and utilisation samples of 1,000 busy
nodes of 8 GPUs, 8,000 1-GPU jobs in 20 teams. Prints µs of process CPU per event.

    .venv/bin/python scripts/bench_telemetry_shell.py
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from services.telemetry.app import TelemetryService
from shared.domain import GpuBinding, JobSpec, NodeSpec, PodSet
from shared.events import (
    GpuSample,
    JobAdmitted,
    JobPending,
    JobPlaced,
    JobStarted,
    JobSubmitted,
    NodeInventory,
    Payload,
    UtilizationSampled,
    make_event,
)

T0 = 1_767_225_600.0
BATCH = 32


def dt(t: float) -> datetime:
    return datetime.fromtimestamp(T0 + t, tz=UTC)


class Conn:
    async def execute(self, *args: Any) -> str:
        return "OK"

    async def fetchval(self, *args: Any) -> None:  # no webhook subscription
        return None


class Tx:
    def __init__(self) -> None:
        self.conn, self.now, self.subject, self.scratch = Conn(), T0 + 50, "", {}
        self.work: Callable[[Any], Awaitable[None]] | None = None

    async def after_events(self, key: str, work: Callable[[Any], Awaitable[None]]) -> None:
        self.work = work


async def per_event_us(svc: TelemetryService, payloads: Sequence[Payload]) -> float:
    events = [make_event(p, source="bench", time=dt(0)) for p in payloads]
    start = time.process_time()
    for k in range(0, len(payloads), BATCH):
        tx = Tx()
        for e, p in zip(events[k:k + BATCH], payloads[k:k + BATCH], strict=True):
            await svc.on_event(tx, e, p)  # type: ignore[arg-type]  # what on_event uses of a Tx
        if tx.work is not None:
            await tx.work(tx)
    return (time.process_time() - start) / len(payloads) * 1e6


async def main(n_nodes: int = 1000, rounds: int = 5) -> None:
    svc = TelemetryService(metrics_port=None, webhook_worker=False)
    inv = tuple(NodeSpec(name=f"n{i:04d}", gpus=8, gpu_model="H100", cpu_milli=1, memory_mib=1, labels={},
                         rack="r", block="b") for i in range(n_nodes))
    svc.apply(NodeInventory(nodes=inv), T0)
    lives = []
    for i in range(n_nodes * 8):
        spec = JobSpec(job_id=f"j{i:05d}", team=f"team-{i % 20}", queue=f"team-{i % 20}",
                       pod_sets=(PodSet(count=1, gpus_per_pod=1),), labels={"feature": f"f{i % 7}"})
        lives.append([
            JobSubmitted(spec=spec, submitted_at=dt(0)),
            JobPending(job_id=spec.job_id, queue=spec.queue, reason="QuotaExhausted", message="",
                       position_in_queue=i, eta=dt(3600)),
            JobAdmitted(job_id=spec.job_id, spec=spec, admitted_at=dt(10)),
            JobPlaced(job_id=spec.job_id, spec=spec, placed_at=dt(11),
                      bindings=(GpuBinding(pod="main-0", node=inv[i // 8].name, gpu_indices=(i % 8,)),)),
            JobStarted(job_id=spec.job_id, started_at=dt(12))])
    job_events: list[Payload] = [life[k] for k in range(5) for life in lives]
    job_us = await per_event_us(svc, job_events)
    samples: list[Payload] = [
        UtilizationSampled(node=n.name, gpu_model="H100", sampled_at=dt(20 + r), interval_s=1.0, source="sim",
                           samples=tuple(GpuSample(job_id=f"j{i * 8 + g:05d}", gpu_index=g, utilization_pct=50.0 + g,
                                                   memory_used_mib=3000, power_w=300.0) for g in range(8)))
        for r in range(rounds) for i, n in enumerate(inv)]
    sample_us = await per_event_us(svc, samples)
    print(f"job event: {job_us:.1f} us ({len(job_events)} events); sample event: {sample_us:.1f} us "
          f"({len(samples)} events, 8 GPUs each)")


if __name__ == "__main__":
    asyncio.run(main())
