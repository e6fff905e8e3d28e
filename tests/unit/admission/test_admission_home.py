"""Event-submitted jobs stay home (issue 44 item 3): the executor creates their workloads with its own rights, so a
job names only a namespace mapped to its team, runs as a ServiceAccount its policy allows (`default` unless it says
otherwise), mounts only the kinds of volume governance judges, and references only the Secrets its policy lists."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from services.core.admission.governance import POLICY_VIOLATION, home_violation, submission_violation
from shared.config import TeamPolicy, parse_queues
from shared.domain import EnvVar, JobSpec, PodSet, PodTemplate, WorkloadRef

HOME = ("ml-team-a", "ml-team-a-batch")


def job(namespace: str | None = None, *, workload: WorkloadRef | None = None, **template: Any) -> JobSpec:
    pod_set = PodSet(count=1, gpus_per_pod=1, template=None if workload else PodTemplate(image="busybox:1", **template))
    return JobSpec(job_id="team-a::j", team="team-a", queue="team-a", namespace=namespace, workload=workload,
                   pod_sets=(pod_set,))


def refusal(spec: JobSpec, policy: TeamPolicy = TeamPolicy(), namespaces: tuple[str, ...] = HOME) -> str | None:
    violation = home_violation(spec, policy, namespaces)
    if violation is None:
        return None
    assert violation.reason == POLICY_VIOLATION
    return violation.message


def test_a_job_names_only_a_namespace_mapped_to_its_team() -> None:
    assert refusal(job()) is None  # the executor picks the team's first namespace
    assert refusal(job("ml-team-a-batch")) is None
    for elsewhere in ("gpuq-system", "kube-system", "ml-team-b", "default"):
        message = refusal(job(elsewhere))
        assert message is not None and f"namespace {elsewhere!r} is not one of team team-a's" in message
        assert "ml-team-a, ml-team-a-batch" in message
    assert "queues.yaml namespaces: none" in (refusal(job("ml-team-a"), namespaces=()) or "")
    # A workload reference from elsewhere is no better (the Kubernetes intake names only the workload's own).
    ref = WorkloadRef(api_version="batch/v1", kind="Job", namespace="gpuq-system", name="x", uid="u")
    assert "workload namespace 'gpuq-system'" in (refusal(job(workload=ref)) or "")
    home = WorkloadRef(api_version="batch/v1", kind="Job", namespace="ml-team-a", name="x", uid="u")
    assert refusal(job(workload=home)) is None


def test_the_namespaces_are_the_ones_queues_yaml_maps_to_the_team() -> None:
    queues = parse_queues({
        "priority_classes": [{"name": "normal", "value": 100}],
        "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 8}}},
                   {"name": "team-b", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 8}}}],
        "namespaces": [{"name": "ml-team-a", "team": "team-a", "queues": ["team-a"]},
                       {"name": "ml-team-b", "team": "team-b", "queues": ["team-b"]}]})
    assert queues.team_namespaces("team-a") == ("ml-team-a",) and queues.team_namespaces("team-c") == ()
    policy = queues.governance.for_team("team-a")
    assert submission_violation(job("ml-team-a"), policy, queues.team_namespaces("team-a")) is None
    assert submission_violation(job("ml-team-b"), policy, queues.team_namespaces("team-a")) is not None
    assert submission_violation(job("ml-team-a"), policy) is not None  # no namespaces given: none is the team's


def test_pods_run_as_default_unless_the_policy_lists_other_service_accounts() -> None:
    assert refusal(job(service_account_name="default")) is None
    message = refusal(job(service_account_name="gpuq-executor"))
    assert message is not None and "ServiceAccount 'gpuq-executor'" in message and "may use default" in message
    trainers = TeamPolicy(allowed_service_accounts=("trainer-*",))
    assert refusal(job(service_account_name="trainer-gpu"), trainers) is None
    assert refusal(job(), trainers) is not None  # `default` is then not in the list


@pytest.mark.parametrize(("volume", "env"), [
    ({"name": "db", "secret": {"secretName": "gpuq-database"}}, None),
    ({"name": "p", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}},
                                             {"secret": {"name": "gpuq-database"}}]}}, None),
    ({"name": "c", "csi": {"driver": "secrets-store.csi.k8s.io", "nodePublishSecretRef": {"name": "gpuq-database"}}},
     None),
    (None, EnvVar(name="DATABASE_URL", value_from={"secretKeyRef": {"name": "gpuq-database", "key": "uri"}})),
])
def test_secrets_are_referenced_only_from_the_teams_list(volume: dict[str, Any] | None, env: EnvVar | None) -> None:
    template: dict[str, Any] = {"volumes": (volume,) if volume else (), "env": (env,) if env else ()}
    message = refusal(job(**template), TeamPolicy(allowed_volume_sources=("csi",)))
    assert message is not None and "references Secret 'gpuq-database'" in message and "no Secret" in message
    assert refusal(job(**template), TeamPolicy(allowed_secrets=("gpuq-*",), allowed_volume_sources=("csi",))) is None


def test_volumes_are_allowed_by_kind() -> None:
    plain = ({"name": "s", "emptyDir": {}}, {"name": "c", "configMap": {"name": "cfg"}},
             {"name": "d", "persistentVolumeClaim": {"claimName": "data"}},
             {"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}})
    assert refusal(job(volumes=plain)) is None
    direct = ({"name": "x", "iscsi": {"targetPortal": "10.0.0.1:3260", "iqn": "iqn.x", "lun": 0}},)
    message = refusal(job(volumes=direct))
    assert message is not None and "is a iscsi volume" in message
    assert refusal(job(volumes=direct), TeamPolicy(allowed_volume_sources=("iscsi",))) is None


def test_env_takes_a_value_or_one_reference_and_no_privileged_field_exists() -> None:
    with pytest.raises(ValidationError, match="exclusive"):
        EnvVar(name="X", value="1", value_from={"fieldRef": {"fieldPath": "metadata.name"}})
    with pytest.raises(ValidationError, match="exactly one of"):
        EnvVar(name="X", value_from={"secretKeyRef": {"name": "a"}, "configMapKeyRef": {"name": "b"}})
    # An event-submitted template has no field for privileged settings, host namespaces or root: asking is invalid.
    for field in ({"privileged": True}, {"host_network": True}, {"host_pid": True}, {"security_context": {}}):
        with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
            PodTemplate(image="busybox:1", **field)
    with pytest.raises(ValidationError):
        PodTemplate(image="busybox:1", run_as_user=0)
