"""Which submissions wait for a platform admin's approval (reason AwaitingApproval, until `gpuq approve JOB`).

Two rules, both from queues.yaml: the team's governance policy names the job's priority class
(`approval_required_classes`), or the job opts out of preemption (`preemptible: false`) in a class that would let it
be preempted and does not allow that for free (`allow_non_preemptible`, default false). A job nobody may preempt
keeps what it holds against every other queue, a lender reclaiming its own guaranteed quota included, so that
guarantee is the platform's to give: a class that is itself never preempted (production), a class an admin marked
`allow_non_preemptible`, or an admin's approval of the one job. (Such a job also never borrows: cycle.py.)

Pure: admission calls it on every submission it receives, whatever path it came by.
"""

from __future__ import annotations

from services.core.admission.admissibility import priority_class
from services.core.admission.governance import needs_approval
from services.core.preemption.model import priority_of
from shared.config import QueuesConfig, TeamPolicy
from shared.domain import JobSpec


def opts_out_of_preemption(spec: JobSpec, config: QueuesConfig) -> bool:
    """Whether the spec makes the job non-preemptible where its class alone would let it be preempted, and the class
    does not allow that (`allow_non_preemptible`)."""
    if spec.preemptible is not False:
        return False
    class_preemptible = priority_of(config, spec.model_copy(update={"preemptible": None}))[1]
    klass = priority_class(config, spec)
    return class_preemptible and not (klass is not None and klass.allow_non_preemptible)


def approval_reason(spec: JobSpec, policy: TeamPolicy, config: QueuesConfig) -> str | None:
    """Why the job waits for an admin's approval (the start of its AwaitingApproval message); None when it needs
    none."""
    if needs_approval(spec, policy):
        return f"priority class {spec.priority_class} needs a platform admin's approval"
    if opts_out_of_preemption(spec, config):
        return (f"it asks not to be preempted (preemptible: false), which priority class {spec.priority_class} does "
                "not allow without a platform admin's approval (allow_non_preemptible)")
    return None
