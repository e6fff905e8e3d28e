"""Model FLOPs utilisation (MFU): the FLOP/s a job achieves divided by the peak of the GPUs it holds.

The contract for jobs: a running job publishes `JobFlopsReported` on its team's subject
(`<ns>.utilization.flops_reported.<team>`, `JobFlopsReported.scoped_subject(team)`, with the team's bus
credential) with its achieved throughput summed over all its GPUs. `flops_event` builds that event from FLOP/s
as training loops count them (e.g. 6 × parameters × tokens per second for a dense transformer); an SDK only has
to publish the result with `shared.service.publish_event`. Telemetry turns the latest report into
`gpuq_job_mfu_ratio` with the peaks of `queues.yaml` `gpu_flavors.<model>.peak_tflops.<precision>`.

Pure: no I/O, no clock (the caller passes the time).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import datetime

from shared.config import GpuFlavor
from shared.domain import Precision
from shared.events import CloudEvent, JobFlopsReported, make_event

TERA = 1e12


def flops_report(job_id: str, achieved_flops_per_s: float, precision: Precision | str, *, at: datetime,
                 step: int | None = None) -> JobFlopsReported:
    """The payload a job publishes: `achieved_flops_per_s` is FLOP/s over all the job's GPUs (not per GPU)."""
    if not math.isfinite(achieved_flops_per_s) or achieved_flops_per_s <= 0:
        raise ValueError(f"achieved_flops_per_s must be a positive finite number, got {achieved_flops_per_s!r}")
    try:
        prec = Precision(precision)
    except ValueError:
        known = ", ".join(p.value for p in Precision)
        raise ValueError(f"unknown precision {precision!r}; one of: {known}") from None
    return JobFlopsReported(job_id=job_id, achieved_tflops=achieved_flops_per_s / TERA, precision=prec,
                            reported_at=at, step=step)


def flops_event(job_id: str, achieved_flops_per_s: float, precision: Precision | str, *, at: datetime,
                source: str, step: int | None = None) -> CloudEvent:
    """The CloudEvent to publish on `JobFlopsReported.scoped_subject(team)` (`source` names the reporter, e.g. the
    pod)."""
    return make_event(flops_report(job_id, achieved_flops_per_s, precision, at=at, step=step), source=source, time=at)


def peak_tflops(gpus: Iterable[tuple[str, int]], precision: Precision,
                flavors: Mapping[str, GpuFlavor]) -> float | None:
    """Peak TFLOP/s of a set of GPUs, given as (GPU model, milli-GPUs held: 1000 per whole GPU, less for a MIG
    slice). None when a model has no configured peak for `precision` (then no MFU is shown, only the proxy)."""
    total = 0.0
    for model, milli in gpus:
        flavor = flavors.get(model)
        peak = flavor.peak_tflops.get(precision) if flavor is not None else None
        if peak is None:
            return None
        total += peak * milli / 1000
    return total if total > 0 else None


def mfu(achieved_tflops: float, peak: float | None) -> float | None:
    """Achieved over peak. More than 1 is physically impossible: the report or the configured peak is wrong, and
    the caller rejects it rather than show a number nobody can trust."""
    if peak is None or peak <= 0:
        return None
    return achieved_tflops / peak
