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
with services.core.pipeline.predict from the job's limit and the history of similar finished jobs, never from
its true duration). Without a prediction the order time is the submit time, the plain FIFO order.
"""

from __future__ import annotations

# A pending job's order inside its queue (and cohort): higher priority first, then older, then job id.
Order = tuple[int, float, str]


def order_time(submitted_at: float, predicted_gpu_s: float | None, queue_nominal_gpus: float,
               job_gpus: float) -> float:
    """The time a job is ordered by (see the module doc); `submitted_at` when there is no prediction."""
    if predicted_gpu_s is None:
        return submitted_at
    if predicted_gpu_s < 0:
        raise ValueError(f"predicted_gpu_s must be >= 0, got {predicted_gpu_s}")
    per = queue_nominal_gpus if queue_nominal_gpus > 0 else max(job_gpus, 1.0)
    return submitted_at + predicted_gpu_s / per


def aged_order_time(submitted_at: float, order_at: float, now: float, max_age_s: float | None) -> float:
    """Wait-time aging (Slurm's age factor, saturating at PriorityMaxAge): the order time a job has at `now`.

    A job's duration offset (order_at − submitted_at) shrinks linearly with its wait and is gone once it waited
    `max_age_s`; from then on it is ordered by its submit time, so no job submitted after it passes it again. Among
    jobs of equal priority and fair-share standing, a job's key only improves while it waits, and a job submitted
    later that is behind it at some instant never overtakes it afterwards: while neither has waited `max_age_s`,
    the gap between their keys is linear in time and either grows or stays at least the gap between their submit
    times; once the earlier job has waited `max_age_s` its key (its submit time) is below any key the later one
    can have (tests/unit/admission/test_admission_aging.py checks it with Hypothesis). Without a
    prediction (order_at == submitted_at) or without aging, the order time is unchanged: FIFO is already aged.
    Pure: `now` is handed in."""
    if max_age_s is None or order_at <= submitted_at:
        return order_at
    if max_age_s <= 0:
        raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
    wait = now - submitted_at
    if wait <= 0:
        return order_at
    if wait >= max_age_s:
        return submitted_at
    return submitted_at + (order_at - submitted_at) * (1.0 - wait / max_age_s)
