"""`gpuq bench runtime`: the CPU each step of the shared runtime's per-message path costs, in one process.

Every service handles every delivery through shared/service.py and shared/events.py, so a microsecond there is
paid ~20 times per job across the six services. This times each step alone with `time.process_time` over many
iterations (CPU time: steadier than wall-clock time on a loaded machine), and then one whole message through the
runtime's handling (`ServiceRuntime._unit`: parse, subject check, inbox claim, span, handler emitting one event,
outbox row) against a connection that does no I/O, so that only the Python side of the path is in the figure.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import typer

from shared.bus import stream_for_subject
from shared.domain import GpuBinding, JobSpec, PodSet
from shared.events import (
    JobPlaced,
    JobStarted,
    JobSubmitted,
    _decode_json,
    encode_event,
    encode_new_event,
    new_event_id,
    parse_event,
)
from shared.service import ServiceRuntime, ServiceSpec, Tx, _BatchWork
from shared.tracing import (
    current_traceparent,
    outgoing_traceparent,
    start_span_from_event,
    traced_event,
    valid_traceparent,
)

_T = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def _spec(i: int = 0) -> JobSpec:
    return JobSpec(job_id=f"job-{i:06d}", team="team-a", queue="team-a", labels={"feature": "f1"},
                   pod_sets=(PodSet(count=2, gpus_per_pod=8),))


def _placed(i: int = 0) -> JobPlaced:
    return JobPlaced(job_id=f"job-{i:06d}", spec=_spec(i), placed_at=_T, fencing_token=3,
                     bindings=(GpuBinding(pod="main-0", node="n0001", gpu_indices=tuple(range(8))),
                               GpuBinding(pod="main-1", node="n0002", gpu_indices=tuple(range(8)))))


class _NoIoConnection:
    """Stands for an asyncpg connection in a batch whose inbox rows were claimed already: nothing is asked."""

    async def execute(self, *args: Any) -> str:
        return ""

    async def fetchval(self, *args: Any) -> Any:
        return None


# Each step is timed this many times and the least kept: another process's load only ever adds to a reading (cache
# and frequency effects reach CPU time too), so the minimum is the steadiest estimate of the step's own cost.
REPEATS = 3


def _per_op_us(fn: Callable[[], Any], iterations: int) -> float:
    fn()  # warm caches once, as a running service has
    best = float("inf")
    for _ in range(REPEATS):
        start = time.process_time()
        for _ in range(iterations):
            fn()
        best = min(best, time.process_time() - start)
    return best / iterations * 1e6


def measure(iterations: int) -> dict[str, float]:
    """Microseconds of CPU per operation, by step."""
    placed = _placed()
    submitted = JobSubmitted(spec=_spec(), submitted_at=_T, submitted_by="team:team-a")
    placed_event = traced_event(placed, source="gpuq/scheduler/0", time=_T)
    placed_raw = encode_event(placed_event)
    submitted_raw = encode_event(traced_event(submitted, source="gpuq/api/0", time=_T))
    parent = placed_event.traceparent
    subject = JobPlaced.subject()
    figures: dict[str, float] = {}

    def span() -> None:
        with start_span_from_event(placed_event):
            pass

    figures["new_event_id"] = _per_op_us(new_event_id, iterations)
    figures["stream_for_subject"] = _per_op_us(lambda: stream_for_subject(subject), iterations)
    figures["valid_traceparent"] = _per_op_us(lambda: valid_traceparent(parent), iterations)
    figures["span_unrecorded"] = _per_op_us(span, iterations)
    with start_span_from_event(placed_event):  # inside a handler's span, as the runtime calls these
        figures["current_traceparent_in_span"] = _per_op_us(current_traceparent, iterations)
        figures["outgoing_traceparent_in_span"] = _per_op_us(outgoing_traceparent, iterations)
        figures["traced_event_placed_in_span"] = _per_op_us(
            lambda: traced_event(placed, source="gpuq/scheduler/0", time=_T), iterations)
    figures["encode_event_placed"] = _per_op_us(lambda: encode_event(placed_event), iterations)
    # what Tx.emit pays for the envelope and body together (the two steps above, without the envelope object)
    figures["encode_new_event_placed"] = _per_op_us(
        lambda: encode_new_event(placed, source="gpuq/scheduler/0", time=_T, traceparent=outgoing_traceparent(parent)),
        iterations)
    figures["json_loads_placed"] = _per_op_us(lambda: json.loads(placed_raw), iterations)
    figures["decode_json_placed"] = _per_op_us(lambda: _decode_json(placed_raw), iterations)
    figures["parse_event_placed"] = _per_op_us(lambda: parse_event(placed_raw), iterations)
    figures["parse_event_submitted"] = _per_op_us(lambda: parse_event(submitted_raw), iterations)
    figures.update(_whole_message(placed_raw, iterations))
    return {k: round(v, 2) for k, v in figures.items()}


def _whole_message(raw: bytes, iterations: int) -> dict[str, float]:
    """One JobPlaced through `_prepare` and `_unit` in a consumed batch (inbox claimed, rows buffered), its handler
    emitting one JobStarted: the runtime's Python per delivery, without Postgres or NATS."""

    async def on_placed(tx: Tx, event: Any, payload: JobPlaced) -> None:
        await tx.emit(JobStarted(job_id=payload.job_id, nodes=("n0001", "n0002"), started_at=_T))

    runtime = ServiceRuntime(ServiceSpec(name="bench", schema="bench", handlers={JobPlaced: on_placed}),
                             nats_url="nats://127.0.0.1:4222", pool=None)
    conn: Any = _NoIoConnection()
    subject = JobPlaced.subject()
    # Distinct event ids, as a stream delivers (the inbox claim is the batch's, so a repeat costs the same).
    first_id = json.loads(raw)["id"].encode()
    bodies = [raw.replace(first_id, str(uuid.uuid4()).encode()) for _ in range(iterations + 1)]

    async def run() -> float:
        async def one(body: bytes) -> None:
            runtime.routed(subject)
            prepared = runtime._prepare(body, subject)
            assert prepared is not None
            batch = _BatchWork(claimed={prepared.inbox_id})
            await runtime._unit(conn, body, subject, {}, [], batch, prepared)

        await one(bodies[0])
        best = float("inf")
        for _ in range(REPEATS):
            start = time.process_time()
            for body in bodies[1:]:
                await one(body)
            best = min(best, time.process_time() - start)
        return best / iterations * 1e6

    return {"whole_message_placed_to_started": asyncio.run(run())}


def bench_runtime(
    iterations: int = typer.Option(20_000, help="Iterations of each step."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """CPU microseconds per step of the runtime's per-message path (events, trace context, routing, handling)."""
    figures = measure(iterations)
    if as_json:
        print(json.dumps({"iterations": iterations, "us_per_op": figures}))
        return
    width = max(len(k) for k in figures)
    for name, us in figures.items():
        print(f"{name:<{width}}  {us:8.2f} us")
