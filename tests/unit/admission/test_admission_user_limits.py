"""Per-user limits (services/core/admission/user_limits.py): a class's max_per_user, the team's per_user max_jobs,
max_gpus and max_notebooks, counted over the same team's and user's other jobs; no user, no limit."""

from __future__ import annotations

from typing import Any

from services.core.admission.user_limits import user_limit_refusal
from shared.config import parse_queues
from shared.domain import JobKind, JobSpec, PodSet


def config(per_user: dict[str, Any] | None = None, classes: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
    doc: dict[str, Any] = {"priority_classes": [{"name": "normal", "value": 0}], "queues": [{"name": "q"}]}
    if per_user is not None:
        doc["governance"] = {"teams": {"t": {"per_user": per_user}}}
    if classes is not None:
        doc["job_classes"] = classes
    return parse_queues(doc)


def job(job_id: str, user: str | None = "alice", team: str = "t", gpus: int = 1,
        kind: JobKind = JobKind.TRAINING) -> JobSpec:
    return JobSpec(job_id=job_id, team=team, queue="q", user=user, kind=kind,
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus),))


def test_notebooks_have_a_default_cap_of_four_per_user() -> None:
    mine = [job(f"nb{i}", kind=JobKind.NOTEBOOK) for i in range(4)]
    refused = user_limit_refusal(job("nb4", kind=JobKind.NOTEBOOK), config(), mine)
    assert refused is not None and refused.reason == "UserLimit" and "max_per_user" in refused.message
    assert user_limit_refusal(job("nb4", user="bob", kind=JobKind.NOTEBOOK), config(), mine) is None
    assert user_limit_refusal(job("nb4", team="u", kind=JobKind.NOTEBOOK), config(), mine) is None
    assert user_limit_refusal(job("t0"), config(), mine) is None  # training: no class cap


def test_team_limits_count_jobs_gpus_and_notebooks() -> None:
    cfg = config({"max_jobs": 3, "max_gpus": 8, "max_notebooks": 1}, {"notebook": {}})
    mine = [job("a", gpus=4), job("b", gpus=2), job("nb", kind=JobKind.NOTEBOOK)]
    over_jobs = user_limit_refusal(job("c"), cfg, mine)
    assert over_jobs is not None and "per_user.max_jobs" in over_jobs.message
    over_gpus = user_limit_refusal(job("c", gpus=3), cfg, mine[:2])
    assert over_gpus is not None and "per_user.max_gpus" in over_gpus.message
    assert user_limit_refusal(job("c", gpus=2), cfg, mine[:2]) is None  # 8 exactly
    over_nb = user_limit_refusal(job("nb2", kind=JobKind.NOTEBOOK), cfg, mine[2:])
    assert over_nb is not None and "per_user.max_notebooks" in over_nb.message
    assert user_limit_refusal(job("c", user=None, gpus=8), cfg, mine) is None  # no user: no per-user limit
    assert user_limit_refusal(job("a", gpus=4), cfg, mine) is None  # itself (a redelivery) is not counted


def test_max_gpus_counts_mig_slices_and_shared_gpus_at_their_fraction() -> None:
    cfg = config({"max_gpus": 1})

    def part(job_id: str, **ps: Any) -> JobSpec:
        return JobSpec(job_id=job_id, team="t", queue="q", user="alice", pod_sets=(PodSet(**ps),))

    mine = [part("m", count=4, mig_profile="1g.10gb"), part("s", count=2, gpu_fraction=0.2)]  # 4 x 1/7 + 0.4
    assert user_limit_refusal(part("s2", count=1, gpu_fraction=0.02), cfg, mine) is None  # 0.968 + 0.02
    over = user_limit_refusal(part("s3", count=1, gpu_fraction=0.1), cfg, mine)
    assert over is not None and "hold 0.968 GPU(s); 0.1 more exceeds" in over.message
