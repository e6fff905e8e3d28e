"""Compatibility: the preemption stage moved into the pipeline core (services/core/pipeline/preempt.py and
loop.py, the one decision loop); `SimPreemption` is its `VictimChooser`."""

from services.core.pipeline.preempt import (
    Preempted,
    PreemptionContext,
    PreemptionHook,
    RunningInfo,
    VictimChooser,
)

SimPreemption = VictimChooser

__all__ = ["Preempted", "PreemptionContext", "PreemptionHook", "RunningInfo", "SimPreemption", "VictimChooser"]
