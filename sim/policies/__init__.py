"""The policies `gpuq simulate` compares (sim/run.py builds them by name)."""

# gpuq: everything on, preemption checkpoints its victims first. gpuq-evict: the same, but victims are evicted
# without a checkpoint (what Kueue/Volcano do), to measure what checkpoint-before-preempt saves.
# gpuq-nopreempt: no preemption at all. gpuq-duration: gpuq with duration-aware ordering (predicted GPU-time,
# shortest first within a priority and fair-share standing, aged; services/core/admission/ordering.py).
# gpuq-fairtime: gpuq with fair share over time (usage decayed with a 7-day half-life, Slurm's default
# PriorityDecayHalfLife; services/core/admission/history.py).
# gpuq-defrag: gpuq with defragmentation moves (checkpointing jobs moved so a gang waiting on scattered GPUs
# starts; services/core/pipeline/defrag.py), on whatever the config says, with the config's bounds.
# gpuq-elastic / gpuq-pods1: gpuq with every job of 2+ GPUs as 1-GPU pods, elastic from half of them (grown and
# shrunk by the decision loop) or fixed (sim/elastic.py: the stated rule and the goodput curve).
# volcano-hami: Volcano with HAMi-like GPU sharing (any GPU takes fractions; sim/policies/hami.py).
POLICIES = ("gpuq", "gpuq-duration", "gpuq-fairtime", "gpuq-evict", "gpuq-nopreempt", "gpuq-defrag", "kueue", "slurm",
            "volcano", "volcano-hami", "quota-fifo", "pod-fifo", "gpuq-elastic", "gpuq-pods1")
