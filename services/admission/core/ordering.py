"""Duration-aware ordering: within the same priority (and, across queues, the same fair-share standing), shorter
predicted work first, with aging so that nothing starves (Tiresias; Helios' QSSF orders by predicted GPU-time).

A job's place is a fixed *order time* instead of its submit time:

    order_at = submitted_at + predicted GPU-seconds ÷ its queue's nominal GPUs

The offset is how long the job alone would occupy its queue's whole guaranteed quota: the delay it imposes on
the jobs behind it. Jobs of one queue therefore go shortest predicted GPU-time first among those submitted
together, and the aging is built in: a job is passed only by jobs submitted less than its own offset after it,
so it waits at most that long for later arrivals (a key that never changes, so queues stay sorted without a
per-cycle re-sort). No constant: the divisor is the queue's own quota (a queue with no nominal quota uses the
job's own GPUs, i.e. its predicted duration).

The core does not predict: callers pass `Workload.predicted_gpu_s` (the simulator and the services compute it
with services.pipeline.core.predict from the job's limit and the history of similar finished jobs, never from
its true duration). Without a prediction the order time is the submit time, the plain FIFO order.
"""

from __future__ import annotations


def order_time(submitted_at: float, predicted_gpu_s: float | None, queue_nominal_gpus: float,
               job_gpus: float) -> float:
    """The time a job is ordered by (see the module doc); `submitted_at` when there is no prediction."""
    if predicted_gpu_s is None:
        return submitted_at
    if predicted_gpu_s < 0:
        raise ValueError(f"predicted_gpu_s must be >= 0, got {predicted_gpu_s}")
    per = queue_nominal_gpus if queue_nominal_gpus > 0 else max(job_gpus, 1.0)
    return submitted_at + predicted_gpu_s / per
