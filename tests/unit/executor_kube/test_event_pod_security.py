"""The pods the executor creates for event-submitted jobs carry the Pod Security `restricted` profile's settings
(issue 44 item 3) unless the team's policy says `baseline`; env references and the user id pass through."""

from __future__ import annotations

from services.core.kube.placement import event_pod_sets
from shared.config import PodSecurity
from shared.domain import EnvVar, JobSpec, PodSet, PodTemplate


def spec(**template: object) -> JobSpec:
    return JobSpec(job_id="team-a::j", team="team-a", queue="team-a", pod_sets=(
        PodSet(name="workers", count=2, gpus_per_pod=1, template=PodTemplate(image="busybox:1", **template)),))


def test_pods_are_restricted_by_default() -> None:
    (ps,) = event_pod_sets(spec())
    pod = ps.template["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    (container,) = pod["containers"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                            "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    for forbidden in ("hostNetwork", "hostPID", "hostIPC", "serviceAccountName"):
        assert forbidden not in pod


def test_baseline_sets_nothing_and_a_user_id_is_kept() -> None:
    (ps,) = event_pod_sets(spec(), PodSecurity.BASELINE)
    assert "securityContext" not in ps.template["spec"]
    assert "securityContext" not in ps.template["spec"]["containers"][0]
    (ps,) = event_pod_sets(spec(run_as_user=1000))
    assert ps.template["spec"]["securityContext"]["runAsUser"] == 1000
    assert ps.template["spec"]["securityContext"]["runAsNonRoot"] is True
    (ps,) = event_pod_sets(spec(run_as_user=1000), PodSecurity.BASELINE)
    assert ps.template["spec"]["securityContext"] == {"runAsUser": 1000}


def test_an_env_reference_reaches_the_container_as_valuefrom() -> None:
    ref = {"secretKeyRef": {"name": "wandb", "key": "token"}}
    (ps,) = event_pod_sets(spec(env=(EnvVar(name="WANDB_API_KEY", value_from=ref), EnvVar(name="EPOCHS", value="3"))))
    env = ps.template["spec"]["containers"][0]["env"]
    assert {"name": "WANDB_API_KEY", "valueFrom": ref} in env and {"name": "EPOCHS", "value": "3"} in env
