"""`python -m gpuq_tools.bench.admission_lock`: CPU of what admission does under its handling lock, without Postgres.

The shape of `gpuq bench e2e steady` (docs/benchmarks.md section 4): 20 team queues and a `waiting` queue (no quota)
in one cohort, `--waiting` jobs pending in it, and batches of `--batch` submissions that fit their queue's quota.
Each timed batch submits its jobs to the core and runs the service's own batch-end work (`AdmissionService.cycle`:
the admission cycle, the status rows it would write, the events it would emit) against a connection that records
statements and does nothing, so only admission's Python cost is measured. Also timed: the ETA loop's snapshot of
the state (`copy.deepcopy` against `AdmissionState.copy`). CPU seconds (time.process_time), not wall clock.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import time
from typing import Any

from services.admission.app import AdmissionService
from services.core.admission import Workload
from shared.config import parse_queues
from shared.domain import JobSpec, PodSet
from shared.service import Tx


class _NullConn:
    """Takes the service's statements and answers nothing (no Postgres on this path)."""

    def __init__(self) -> None:
        self.statements = 0
        self.rows = 0

    async def execute(self, sql: str, *args: Any) -> str:
        self.statements += 1
        self.rows += 1
        return ""

    async def executemany(self, sql: str, rows: Any) -> None:
        self.statements += 1
        self.rows += len(rows)

    async def fetch(self, sql: str, *args: Any) -> list[Any]:
        self.statements += 1
        return []

    async def fetchval(self, sql: str, *args: Any) -> Any:
        self.statements += 1
        return None


def _config(queues: int, nodes: int) -> Any:
    per_queue = nodes * 8 // queues
    return parse_queues({
        "priority_classes": [{"name": "normal", "value": 100}],
        "cohorts": [{"name": "bench"}],
        "queues": [{"name": f"team-{i:02d}", "cohort": "bench", "quotas": {"H100-80GB": {"nominal": per_queue}}}
                   for i in range(queues)]
        + [{"name": "waiting", "cohort": "bench", "quotas": {"H100-80GB": {"nominal": 1, "borrowing_limit": 0}}}],
    }, "<bench>")


def _job(job_id: str, queue: str, at: float) -> Workload:
    spec = JobSpec(job_id=job_id, team=queue, queue=queue,
                   pod_sets=(PodSet(count=1, gpus_per_pod=1, gpu_models=("H100-80GB",)),))
    return Workload(spec, at)


def run(waiting: int, batches: int, batch: int, queues: int, nodes: int, copies: int) -> dict[str, Any]:
    svc = AdmissionService(_config(queues, nodes))
    conn = _NullConn()
    now = 1_000_000.0

    def tx() -> Tx:
        return Tx(conn=conn, now=now, source="bench", schema="admission", buffered=True)

    for i in range(waiting):
        assert svc.state.submit(_job(f"wait-{i:06d}", "waiting", now - waiting + i)) is None
    asyncio.run(svc.cycle(tx()))  # the backlog's statuses are published once (untimed)
    out: dict[str, Any] = {"waiting": waiting, "batch": batch, "batches": batches}

    async def batches_timed() -> list[float]:
        nonlocal now
        times, n = [], 0
        for _ in range(batches):
            now += 1.0
            # jobs that ran long enough end (about as many as arrive, as in the steady scenario)
            for job_id in sorted(svc.state.admitted)[:batch]:
                if not job_id.startswith("wait-"):
                    svc.state.finish(job_id)
            t = tx()
            start = time.process_time()
            for _ in range(batch):
                assert svc.state.submit(_job(f"fit-{n:07d}", f"team-{n % queues:02d}", now)) is None
                n += 1
            await svc.cycle(t)
            times.append(time.process_time() - start)
        return times

    conn.statements = conn.rows = 0
    times = asyncio.run(batches_timed())
    out["batch_cpu_ms_p50"] = round(statistics.median(times) * 1000, 2)
    out["batch_cpu_ms_min"] = round(min(times) * 1000, 2)  # the least disturbed by other load
    out["batch_cpu_ms_max"] = round(max(times) * 1000, 2)
    out["per_job_cpu_us"] = round(sum(times) / (batches * batch) * 1e6, 1)
    out["rows_written_per_batch"] = round(conn.rows / batches, 1)
    for name, fn in (("deepcopy", copy.deepcopy), ("copy", lambda s: s.copy())):
        start = time.process_time()
        for _ in range(copies):
            fn(svc.state)
        out[f"snapshot_{name}_cpu_ms"] = round((time.process_time() - start) / copies * 1000, 2)
    out["pending"] = len(svc.state.pending)
    out["admitted"] = len(svc.state.admitted)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--waiting", type=int, default=10_000)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--queues", type=int, default=20)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--copies", type=int, default=5)
    a = p.parse_args()
    print(json.dumps(run(a.waiting, a.batches, a.batch, a.queues, a.nodes, a.copies)))


if __name__ == "__main__":
    main()
