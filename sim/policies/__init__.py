"""The policies `gpuq simulate` compares (sim/run.py builds them by name)."""

# gpuq: everything on, preemption checkpoints its victims first. gpuq-evict: the same, but victims are evicted
# without a checkpoint (what Kueue/Volcano do), to measure what checkpoint-before-preempt saves.
# gpuq-nopreempt: no preemption at all. gpuq-duration: gpuq with duration-aware ordering (predicted GPU-time,
# shortest first within a priority and fair-share standing, aged; services/core/admission/ordering.py).
# gpuq-fairtime: gpuq with fair share over time (usage decayed with a 7-day half-life, Slurm's default
# PriorityDecayHalfLife; services/core/admission/history.py).
# volcano-hami: Volcano with HAMi-like GPU sharing (any GPU takes fractions; sim/policies/hami.py).
POLICIES = ("gpuq", "gpuq-duration", "gpuq-fairtime", "gpuq-evict", "gpuq-nopreempt", "kueue", "slurm", "volcano",
            "volcano-hami", "quota-fifo", "pod-fifo")
