"""Policy on what Kubernetes runs (issue 44 item 2): every pod template of every kind, every container, judged by the
governance rules event-submitted jobs are judged by; and the admission webhook's decisions (issue 44 item 1)."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from services.core.kube.admission import Review, WebhookPolicy, mutate, response, validate
from services.core.kube.intake import Refusal, job_spec, policy_refusal
from services.core.kube.kinds import kind_of
from shared.config import KubernetesSource, QueuesConfig, parse_queues
from tests.unit.executor_kube.conftest import QUEUES, container, job, pod_template, pytorchjob

JOB = kind_of("batch/v1", "Job")
RAYJOB = kind_of("ray.io/v1", "RayJob")
PYTORCH = kind_of("kubeflow.org/v1", "PyTorchJob")
POLICY = {"default": {"allowed_images": ["ghcr.io/example"], "allowed_datasets": ["datasets/*"]}}


@pytest.fixture
def governed() -> QueuesConfig:
    return parse_queues({**QUEUES, "governance": POLICY})


def _attack_job() -> dict[str, Any]:
    """The kubectl policy bypass: a suspended Job running a miner with an inline cloud key and a foreign claim."""
    obj = job()
    spec = obj["spec"]["template"]["spec"]
    spec["containers"] = [container(image="docker.io/evil/miner",
                                    env=[{"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI/K7MDENG"}])]
    spec["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": "team-b-private"}}]
    return obj


def _refusal(obj: dict[str, Any], queues: QueuesConfig, cfg: KubernetesSource, kind: Any = JOB) -> Refusal | None:
    spec = job_spec(kind, obj, queues, cfg)
    assert not isinstance(spec, Refusal), spec
    return policy_refusal(kind, obj, spec, queues)


def test_the_kubectl_bypass_is_refused_at_intake_naming_each_rule(governed: QueuesConfig,
                                                                 kube_cfg: KubernetesSource) -> None:
    obj = _attack_job()
    refusal = _refusal(obj, governed, kube_cfg)
    assert refusal is not None and refusal.reason == "PolicyViolation"
    assert "docker.io/evil/miner" in refusal.message and "(rule: allowed_images)" in refusal.message
    spec = obj["spec"]["template"]["spec"]
    spec["containers"][0]["image"] = "ghcr.io/example/train:1"  # an allowed image: the claim is next
    refusal = _refusal(obj, governed, kube_cfg)
    assert refusal is not None and "team-b-private" in refusal.message and "allowed_datasets" in refusal.message
    spec["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets/imagenet"}}]
    refusal = _refusal(obj, governed, kube_cfg)  # an allowed claim: the inline key is next
    assert refusal is not None and "AWS_SECRET_ACCESS_KEY" in refusal.message
    assert "(rule: secrets_by_reference_only)" in refusal.message
    spec["containers"][0]["env"] = [{"name": "AWS_SECRET_ACCESS_KEY",
                                     "valueFrom": {"secretKeyRef": {"name": "aws", "key": "secret"}}}]
    assert _refusal(obj, governed, kube_cfg) is None  # by reference


@pytest.mark.parametrize(("setting", "expected"), [
    ({"hostNetwork": True}, "hostNetwork"), ({"hostPID": True}, "hostPID"), ({"hostIPC": True}, "hostIPC"),
    ({"containers": [container(securityContext={"privileged": True})]}, "privileged"),
    ({"initContainers": [container(gpus=0, securityContext={"capabilities": {"add": ["SYS_ADMIN"]}})]},
     "SYS_ADMIN"),
    ({"containers": [container(ports=[{"containerPort": 80, "hostPort": 80}])]}, "hostPort 80"),
    ({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}, "hostPath"),
    ({"volumes": [{"name": "n", "nfs": {"server": "10.0.0.9", "path": "/exports/team-b"}}]}, "10.0.0.9"),
])
def test_privileged_settings_host_namespaces_and_storage_are_refused(
        governed: QueuesConfig, kube_cfg: KubernetesSource, setting: dict[str, Any], expected: str) -> None:
    obj = job()
    obj["spec"]["template"]["spec"].update(setting)
    refusal = _refusal(obj, governed, kube_cfg)
    assert refusal is not None and expected in refusal.message, refusal


def test_a_policy_may_allow_privileged_pods_and_name_service_accounts(kube_cfg: KubernetesSource) -> None:
    queues = parse_queues({**QUEUES, "governance": {"default": {"allow_privileged": True,
                                                                "allowed_service_accounts": ["trainer"]}}})
    obj = job()
    obj["spec"]["template"]["spec"].update(hostNetwork=True, serviceAccountName="trainer")
    assert _refusal(obj, queues, kube_cfg) is None
    obj["spec"]["template"]["spec"]["serviceAccountName"] = "admin"
    refusal = _refusal(obj, queues, kube_cfg)
    assert refusal is not None and "'admin'" in refusal.message and "allowed_service_accounts" in refusal.message


def test_every_template_of_every_kind_is_read(governed: QueuesConfig, kube_cfg: KubernetesSource) -> None:
    """A RayJob's worker group scaled to zero and its submitter pod, a PyTorchJob's second replica type."""
    bad = pod_template(gpus=0)
    bad["spec"]["containers"][0]["image"] = "docker.io/evil/miner"
    ray = {"apiVersion": "ray.io/v1", "kind": "RayJob",
           "metadata": {"name": "r", "namespace": "ml-a", "uid": "u-1", "labels": {"gpuq.io/queue": "team-a"}},
           "spec": {"suspend": True, "rayClusterSpec": {
               "headGroupSpec": {"template": pod_template(gpus=0)},
               "workerGroupSpecs": [{"groupName": "gpu", "replicas": 1, "template": pod_template()},
                                    {"groupName": "idle", "replicas": 0, "template": bad}]}}}
    refusal = _refusal(ray, governed, kube_cfg, RAYJOB)
    assert refusal is not None and "pod template idle" in refusal.message
    ray["spec"]["rayClusterSpec"]["workerGroupSpecs"].pop()
    ray["spec"]["submitterPodTemplate"] = bad
    refusal = _refusal(ray, governed, kube_cfg, RAYJOB)
    assert refusal is not None and "pod template submitter" in refusal.message
    pt = pytorchjob()
    pt["spec"]["pytorchReplicaSpecs"]["Master"] = {"replicas": 1, "template": bad}
    refusal = _refusal(pt, governed, kube_cfg, PYTORCH)
    assert refusal is not None and "pod template master" in refusal.message


def test_the_user_annotation_is_the_user_only_where_the_webhook_writes_it(queues: QueuesConfig,
                                                                          kube_cfg: KubernetesSource) -> None:
    obj = job(annotations={"gpuq.io/user": "alice"})
    spec = job_spec(JOB, obj, queues, kube_cfg)
    assert not isinstance(spec, Refusal) and spec.user is None
    spec = job_spec(JOB, obj, queues, kube_cfg, user_of_record=True)
    assert not isinstance(spec, Refusal) and spec.user == "alice"


# ----------------------------------------------------------------------------- the webhook's decisions


def review(obj: dict[str, Any], *, operation: str = "CREATE", user: str = "bob", old: dict[str, Any] | None = None,
           namespace: str = "ml-a") -> Review:
    api_version = obj["apiVersion"]
    group, _, version = api_version.rpartition("/")
    return Review.parse({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "req-1", "kind": {"group": group, "version": version, "kind": obj["kind"]}, "operation": operation,
        "namespace": namespace, "userInfo": {"username": user}, "object": obj, "oldObject": old}})


def patched(obj: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    import jsonpatch

    return jsonpatch.apply_patch(copy.deepcopy(obj), ops)


@pytest.fixture
def policy(governed: QueuesConfig) -> WebhookPolicy:
    return WebhookPolicy(queues=governed, trusted_users=frozenset({"system:serviceaccount:gpuq:gpuq-executor"}))


def test_an_unsuspended_unlabelled_gpu_job_is_suspended_queued_and_stamped(policy: WebhookPolicy) -> None:
    obj = job(suspend=False)
    del obj["metadata"]["labels"]
    del obj["metadata"]["annotations"]
    answer = mutate(review(obj), policy)
    assert answer.allowed and answer.warnings
    out = patched(obj, answer.patch)
    assert out["spec"]["suspend"] is True
    assert out["metadata"]["labels"] == {"gpuq.io/queue": "team-a"}
    assert out["metadata"]["annotations"] == {"gpuq.io/user": "bob"}
    assert validate(review(out), policy).allowed
    # A PyTorchJob suspends through runPolicy, which it may not have.
    pt = pytorchjob()
    del pt["spec"]["runPolicy"]
    out = patched(pt, mutate(review(pt), policy).patch)
    assert out["spec"]["runPolicy"] == {"suspend": True}
    reply = response("req-1", mutate(review(pt), policy))["response"]
    assert reply["patchType"] == "JSONPatch" and json.loads(base64.b64decode(reply["patch"]))


def test_what_is_not_gpuqs_is_left_alone(policy: WebhookPolicy) -> None:
    cpu = job(suspend=False)
    cpu["spec"]["template"] = pod_template(gpus=0)
    del cpu["metadata"]["labels"]
    assert mutate(review(cpu), policy).patch == [] and validate(review(cpu), policy).allowed
    elsewhere = job(suspend=False, namespace="scratch")
    assert mutate(review(elsewhere, namespace="scratch"), policy).patch == []
    assert validate(review(elsewhere, namespace="scratch"), policy).allowed
    gpuq = job(suspend=False, annotations={"gpuq.io/job-id": "x"})
    trusted = "system:serviceaccount:gpuq:gpuq-executor"
    assert mutate(review(gpuq, user=trusted), policy).patch == []
    assert validate(review(gpuq, user=trusted), policy).allowed


@pytest.mark.parametrize("key", ["gpuq.io/job-id", "gpuq.io/status", "gpuq.io/user", "gpuq.io/binding"])
def test_gpuqs_own_annotations_are_refused_to_users(policy: WebhookPolicy, key: str) -> None:
    answer = validate(review(job(annotations={key: "team-a::victim"})), policy)
    assert not answer.allowed and key in answer.message
    # ... changed later, or removed
    old = job(annotations={key: "bob" if key == "gpuq.io/user" else "mine"})
    assert not validate(review(job(annotations={key: "alice"}), operation="UPDATE", old=old), policy).allowed
    assert not validate(review(job(), operation="UPDATE", old=old), policy).allowed
    assert validate(review(copy.deepcopy(old), operation="UPDATE", old=old), policy).allowed


def test_template_labels_of_gpuq_and_foreign_queues_are_refused(policy: WebhookPolicy) -> None:
    obj = job()
    obj["spec"]["template"]["metadata"]["labels"]["gpuq.io/job"] = "0123"
    assert "gpuq.io/job" in validate(review(obj), policy).message
    answer = validate(review(job(labels={"gpuq.io/queue": "team-b"})), policy)
    assert not answer.allowed and "queue 'team-b' is not open to namespace ml-a" in answer.message


def test_only_gpuq_resumes_a_gpu_workload(policy: WebhookPolicy) -> None:
    old, new = job(suspend=True), job(suspend=False)
    answer = validate(review(new, operation="UPDATE", old=old), policy)
    assert not answer.allowed and "only gpuq resumes" in answer.message
    assert validate(review(new, operation="UPDATE", old=old, user="system:serviceaccount:gpuq:gpuq-executor"),
                    policy).allowed
    assert not validate(review(job(suspend=False)), policy).allowed  # created running (past the mutation)


def test_policy_is_judged_at_the_webhook(policy: WebhookPolicy) -> None:
    answer = validate(review(_attack_job()), policy)
    assert not answer.allowed and "(rule: allowed_images)" in answer.message


def _pod(gated: bool, gpus: int = 1, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = {"containers": [container(gpus=gpus)], **({"schedulingGates": [{"name": "gpuq.io/placement"}]}
                                                      if gated else {})}
    meta: dict[str, Any] = {"name": "p", "namespace": "ml-a"}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def test_a_gpu_pod_runs_only_where_gpuq_places_it(policy: WebhookPolicy) -> None:
    bare = validate(review(_pod(gated=False)), policy)
    assert not bare.allowed and "create a batch/v1 Job" in bare.message and "default queue team-a" in bare.message
    assert validate(review(_pod(gated=True)), policy).allowed  # a placed workload's pod, held by its gate
    assert validate(review(_pod(gated=False, gpus=0)), policy).allowed
    ungated = validate(review(_pod(gated=False), operation="UPDATE", old=_pod(gated=True)), policy)
    assert not ungated.allowed and "only gpuq removes" in ungated.message
    deployment = validate(review(_pod(gated=False, owner={"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                                          "name": "rs", "uid": "1", "controller": True})), policy)
    assert not deployment.allowed and "ReplicaSet rs" in deployment.message


def test_a_malformed_review_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="AdmissionReview"):
        Review.parse({"kind": "AdmissionReview"})
