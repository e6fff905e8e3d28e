"""Per-user limits inside a team, judged at submit (issue 48, items 1 and 5): a job kind's `max_per_user`
(`job_classes`; notebooks: 4 by default) and the team's `per_user` limits (concurrent jobs, their GPUs, notebooks).
GPUs count MIG slices and shared GPUs at the fraction of a GPU they take, so such jobs cannot pass max_gpus.

The user is the job's `user`, which the authenticated producer stamped (the API: the token's principal, refusing a
body that names another; Kubernetes: the admission review's userInfo, `gpuq.io/user`), never a name a submitter chose.
A job with no user (an event-submitted job of a team's service credential) is under no per-user limit: the team's
limits still apply. Counted over the user's jobs of the same team that wait or run (and those held for approval).

Pure: the caller passes the jobs to count.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.core.admission.governance import Violation
from shared.config import QueuesConfig
from shared.domain import MILLI_GPU, JobKind, JobSpec, mig_milli_gpus

USER_LIMIT = "UserLimit"


def user_limit_refusal(spec: JobSpec, config: QueuesConfig, others: Iterable[JobSpec]) -> Violation | None:
    """A Violation when admitting `spec` to the queues would take its user past a limit; `others` are the jobs
    waiting or running now (any team: only the same team's and user's are counted; `spec` itself is skipped)."""
    user = spec.user
    limits = config.governance.for_team(spec.team).per_user
    kind_cap = config.job_class(spec.kind).max_per_user
    if not user or (limits is None and kind_cap is None):
        return None
    mine = [o for o in others if o.user == user and o.team == spec.team and o.job_id != spec.job_id]
    same_kind = sum(1 for o in mine if o.kind is spec.kind)
    if kind_cap is not None and same_kind >= kind_cap:
        return Violation(USER_LIMIT, f"job {spec.job_id}: user {user} already has {same_kind} {spec.kind.value} "
                                     f"job(s) waiting or running, the class's limit (job_classes.{spec.kind.value}."
                                     "max_per_user); end one first")
    if limits is None:
        return None
    notebooks = sum(1 for o in mine if o.kind is JobKind.NOTEBOOK)
    if spec.kind is JobKind.NOTEBOOK and limits.max_notebooks is not None and notebooks >= limits.max_notebooks:
        return Violation(USER_LIMIT, f"job {spec.job_id}: user {user} already has {notebooks} notebook(s) waiting or "
                                     f"running, team {spec.team}'s per-user limit (per_user.max_notebooks)")
    if limits.max_jobs is not None and len(mine) >= limits.max_jobs:
        return Violation(USER_LIMIT, f"job {spec.job_id}: user {user} already has {len(mine)} job(s) waiting or "
                                     f"running, team {spec.team}'s per-user limit (per_user.max_jobs)")
    held = sum(_milli_gpus(o) for o in mine)
    if limits.max_gpus is not None and held + _milli_gpus(spec) > limits.max_gpus * MILLI_GPU:
        return Violation(USER_LIMIT, f"job {spec.job_id}: user {user}'s jobs waiting or running hold "
                                     f"{held / MILLI_GPU:g} GPU(s); {_milli_gpus(spec) / MILLI_GPU:g} more exceeds "
                                     f"team {spec.team}'s per-user limit of {limits.max_gpus} (per_user.max_gpus)")
    return None


def _milli_gpus(spec: JobSpec) -> int:
    """The GPUs a job asks for in milli-GPUs: whole GPUs, a MIG slice as its fraction of a GPU, a pod sharing a GPU
    as its gpu_fraction (a pod asking only GPU memory counts none: its share depends on the node's GPU)."""
    mig = sum(ps.count * mig_milli_gpus(ps.mig_profile) for ps in spec.pod_sets if ps.mig_profile)
    return spec.total_gpus * MILLI_GPU + mig + spec.total_share_milli
