"""gpuq's admission webhook (issue 44 item 1), served for real over HTTPS and called by the API server (the fake,
which calls registered webhooks as kube-apiserver does, or GPUQ_KUBECONFIG's cluster) on what a team's user
creates with kubectl, through the real HTTP client. Each attack is one test:

- a GPU Job created running (and without a queue) ran outside every quota: it is suspended and queued;
- a bare GPU pod ran outside gpuq: it is refused, saying how to submit;
- a user-set `gpuq.io/*` annotation (job id, user) was believed: it is refused; the user of record is the request's;
- a user resumed a suspended GPU Job itself: refused (only gpuq's identity may);
- the kubectl policy bypass (a miner image, an inline cloud key, another team's claim): refused at creation;
and what must not change: namespaces gpuq does not manage are untouched, gpuq's own identity is not judged, and
with the webhook down only GPU workloads and pods in managed namespaces wait (failurePolicy Fail there; the
configurations' CEL matchConditions send nothing else: CPU work and other namespaces go on), while what carries a
`gpuq.io/` key still reaches validation. Certificates: gpuq's self-signed CA in its Secret and in both
configurations' caBundle, replaced before it expires with the old CA kept beside the new one.

On a real cluster the API server must reach this machine: set GPUQ_KUBE_WEBHOOK_HOST to an address of it the API
server can reach (a kind cluster: the docker bridge's gateway); the fake uses 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.resources.core_v1 import Pod, Secret
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding
from lightkube.types import PatchType

from services.executor.kube.certs import CertPair
from services.executor.kube.client import KubeApi, load_config
from services.executor.kube.webhook import WebhookServer, WebhookSettings
from shared.config import QueuesConfig, parse_queues
from shared.servers import free_port
from tests.kube.kubefake.cluster import KubeCluster
from tests.kube.kubefake.kinds import (
    JobSet,
    LeaderWorkerSet,
    MPIJob,
    Notebook,
    PyTorchJob,
    RayJob,
    TFJob,
)
from tests.kube_support import kind_body, webhook_configurations

MANAGED, ELSEWHERE, SYSTEM = "wh-team-a", "wh-scratch", "wh-gpuq-system"
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")
MUTATING = create_global_resource("admissionregistration.k8s.io", "v1", "MutatingWebhookConfiguration",
                                  "mutatingwebhookconfigurations")
VALIDATING = create_global_resource("admissionregistration.k8s.io", "v1", "ValidatingWebhookConfiguration",
                                    "validatingwebhookconfigurations")
QUEUES: QueuesConfig = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 16}}},
               {"name": "team-b", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 16}}}],
    "namespaces": [{"name": MANAGED, "team": "team-a", "queues": ["team-a"]}],
    "governance": {"default": {"allowed_images": ["ghcr.io/example"], "allowed_datasets": ["datasets/*"]}},
})


def job_body(name: str, *, gpus: int = 1, suspend: bool | None = None, labels: dict[str, str] | None = None,
             annotations: dict[str, str] | None = None, image: str = "ghcr.io/example/train:1",
             env: list[dict[str, Any]] | None = None, volumes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    spec: dict[str, Any] = {"backoffLimit": 0, "template": {"spec": {
        "restartPolicy": "Never", "volumes": volumes or [],
        "containers": [{"name": "main", "image": image, "command": ["sleep", "30"], "env": env or [],
                        "resources": {"limits": limits, "requests": {"cpu": "100m", "memory": "64Mi"}}}]}}}
    if suspend is not None:
        spec["suspend"] = suspend
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}}, "spec": spec}


KINDS = {"Job": JOB, "JobSet": JobSet, "PyTorchJob": PyTorchJob, "TFJob": TFJob, "MPIJob": MPIJob, "RayJob": RayJob,
         "Notebook": Notebook, "LeaderWorkerSet": LeaderWorkerSet,
         # generic (dict) as the custom kinds, so that the test reads every kind's answer alike
         "StatefulSet": create_namespaced_resource("apps", "v1", "StatefulSet", "statefulsets")}
RUN_POLICY = ("PyTorchJob", "TFJob", "MPIJob")  # suspended through spec.runPolicy.suspend


def suspended(obj: dict[str, Any]) -> bool:
    if obj["kind"] in ("LeaderWorkerSet", "StatefulSet"):  # held at zero groups / replicas
        return obj["spec"].get("replicas", 1) == 0
    if obj["kind"] == "Notebook":  # stopped as Kubeflow stops one
        return "kubeflow-resource-stopped" in (obj["metadata"].get("annotations") or {})
    spec = obj["spec"]
    return bool((spec.get("runPolicy") or {}).get("suspend") if obj["kind"] in RUN_POLICY else spec.get("suspend"))


def pod_body(name: str, gpus: int = 1) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "containers": [{"name": "main", "image": "ghcr.io/example/train:1",
                                                  "command": ["sleep", "30"], "resources": {"limits": limits}}]}}


@dataclass
class Webhook:
    server: WebhookServer
    task: asyncio.Task[None]
    name: str  # of both configurations
    user: AsyncClient  # a team-a user (a ServiceAccount with a Role in its namespace)
    username: str
    gpuq: AsyncClient  # gpuq's own identity (the kubeconfig's)


async def _user_client(kube_api: KubeCluster, tmp_path: Path) -> tuple[AsyncClient, str]:
    """A team user: may create and change Jobs and Pods in the managed and the unmanaged namespace, nothing else."""
    client = kube_api.client()
    for ns in (MANAGED, ELSEWHERE):
        await kube_api.create_service_account(MANAGED, "alice") if ns == MANAGED else None
        await client.create(Role.from_dict({"metadata": {"name": "alice", "namespace": ns}, "rules": [
            {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "update", "patch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "update", "patch"]},
            {"apiGroups": ["jobset.x-k8s.io", "kubeflow.org", "ray.io", "leaderworkerset.x-k8s.io", "apps"],
             "resources": ["jobsets", "pytorchjobs", "tfjobs", "mpijobs", "rayjobs", "notebooks", "leaderworkersets",
                           "statefulsets"],
             "verbs": ["create", "get", "update", "patch"]}]}))
        await client.create(RoleBinding.from_dict({
            "metadata": {"name": "alice", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "alice"},
            "subjects": [{"kind": "ServiceAccount", "name": "alice", "namespace": MANAGED}]}))
    token = await kube_api.service_account_token(MANAGED, "alice")
    path = kube_api.token_kubeconfig(token, tmp_path / "alice.yaml")
    return AsyncClient(KubeConfig.from_file(path)), f"system:serviceaccount:{MANAGED}:alice"


@pytest_asyncio.fixture
async def webhook(kube_api: KubeCluster, tmp_path: Path) -> AsyncIterator[Webhook]:
    host = os.environ.get("GPUQ_KUBE_WEBHOOK_HOST", "127.0.0.1")
    port = free_port()
    name = f"gpuq-test-{uuid.uuid4().hex[:6]}"
    for ns in (SYSTEM, MANAGED, ELSEWHERE):
        await kube_api.create_namespace(ns)
    mutating, validating = webhook_configurations(name, f"https://{host}:{port}", [MANAGED])
    client = kube_api.client()
    await client.create(MUTATING(mutating))
    await client.create(VALIDATING(validating))
    settings = WebhookSettings(port=port, bind="127.0.0.1" if host == "127.0.0.1" else "0.0.0.0", namespace=SYSTEM,
                               configurations=(name,), hosts=(host,), trusted_users=(await kube_api.username(),))
    server = WebhookServer(settings, QUEUES, KubeApi(load_config(kube_api.kubeconfig)))
    task = asyncio.create_task(server.serve())
    user, username = await _user_client(kube_api, tmp_path)
    try:
        await asyncio.wait_for(server.started.wait(), 30)
        yield Webhook(server, task, name, user, username, client)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.api.close()
        await user.close()
        for res in (MUTATING, VALIDATING):
            with contextlib.suppress(ApiError):
                await client.delete(res, name)


async def stop(webhook: Webhook) -> None:
    """gpuq's webhook goes down (its configurations stay, as while the executor restarts)."""
    webhook.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await webhook.task


async def refused(call: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        await call
    return info.value


async def test_a_gpu_job_created_running_without_a_queue_is_suspended_and_queued(webhook: Webhook) -> None:
    created = await webhook.user.create(JOB(job_body("eager", suspend=False)), namespace=MANAGED)
    assert created["spec"]["suspend"] is True
    assert created["metadata"]["labels"]["gpuq.io/queue"] == "team-a"  # the namespace's default queue
    assert created["metadata"]["annotations"]["gpuq.io/user"] == webhook.username  # the request's user


async def test_a_bare_gpu_pod_is_refused_saying_how_to_submit(webhook: Webhook) -> None:
    error = await refused(webhook.user.create(Pod.from_dict(pod_body("miner")), namespace=MANAGED))
    assert error.status.code == 403
    assert "GPU pods run through gpuq" in str(error.status.message)
    assert "create a batch/v1 Job" in str(error.status.message)
    await webhook.user.create(Pod.from_dict(pod_body("cpu", gpus=0)), namespace=MANAGED)  # no GPU: not gpuq's


@pytest.mark.parametrize("annotations", [{"gpuq.io/job-id": "ml-team-a.victim.0123abcd"},
                                         {"gpuq.io/user": "system:serviceaccount:wh-team-a:bob"},
                                         {"gpuq.io/status": "Running"}])
async def test_a_user_set_gpuq_annotation_is_refused(webhook: Webhook, annotations: dict[str, str]) -> None:
    (key,) = annotations
    error = await refused(webhook.user.create(JOB(job_body("forged", suspend=True, annotations=annotations)),
                                              namespace=MANAGED))
    assert error.status.code == 403 and key in str(error.status.message)


async def test_the_user_of_record_cannot_be_changed_later(webhook: Webhook) -> None:
    await webhook.user.create(JOB(job_body("mine", suspend=True)), namespace=MANAGED)
    error = await refused(webhook.user.patch(JOB, "mine", {"metadata": {"annotations": {"gpuq.io/user": "bob"}}},
                                             namespace=MANAGED, patch_type=PatchType.MERGE))
    assert "gpuq.io/user" in str(error.status.message)


async def test_only_gpuq_resumes_a_suspended_gpu_job(webhook: Webhook) -> None:
    await webhook.user.create(JOB(job_body("held", suspend=True)), namespace=MANAGED)
    error = await refused(webhook.user.patch(JOB, "held", {"spec": {"suspend": False}}, namespace=MANAGED,
                                             patch_type=PatchType.MERGE))
    assert "only gpuq resumes" in str(error.status.message)
    resumed = await webhook.gpuq.patch(JOB, "held", {"spec": {"suspend": False}}, namespace=MANAGED,
                                       patch_type=PatchType.MERGE)
    assert resumed["spec"]["suspend"] is False  # gpuq's own identity: as it does when it places the job


async def test_a_queue_the_namespace_may_not_use_is_refused(webhook: Webhook) -> None:
    error = await refused(webhook.user.create(JOB(job_body("other", labels={"gpuq.io/queue": "team-b"})),
                                              namespace=MANAGED))
    assert "queue 'team-b' is not open to namespace wh-team-a" in str(error.status.message)


async def test_the_kubectl_policy_bypass_is_refused_at_creation(webhook: Webhook) -> None:
    body = job_body("miner", suspend=True, image="docker.io/evil/miner",
                    env=[{"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI/K7MDENG"}],
                    volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "team-b-private"}}])
    error = await refused(webhook.user.create(JOB(body), namespace=MANAGED))
    assert "docker.io/evil/miner" in str(error.status.message) and "allowed_images" in str(error.status.message)


async def test_namespaces_gpuq_does_not_manage_are_untouched(webhook: Webhook) -> None:
    created = await webhook.user.create(JOB(job_body("free", suspend=False)), namespace=ELSEWHERE)
    assert created["spec"].get("suspend") in (None, False) and "gpuq.io/queue" not in created["metadata"]["labels"]
    await webhook.user.create(Pod.from_dict(pod_body("free-pod")), namespace=ELSEWHERE)


async def test_with_the_webhook_down_only_gpu_workloads_in_managed_namespaces_wait(webhook: Webhook) -> None:
    await stop(webhook)
    error = await refused(webhook.user.create(JOB(job_body("blocked", suspend=True)), namespace=MANAGED))
    assert error.status.code == 500 and "failed calling webhook" in str(error.status.message)  # failurePolicy Fail
    error = await refused(webhook.user.create(Pod.from_dict(pod_body("blocked-pod")), namespace=MANAGED))
    assert error.status.code == 500 and "failed calling webhook" in str(error.status.message)
    # CPU work in a managed namespace is not sent to gpuq (matchConditions), so it does not wait for it.
    cpu = await webhook.user.create(JOB(job_body("cpu", gpus=0, suspend=False)), namespace=MANAGED)
    assert cpu["spec"]["suspend"] is False and "gpuq.io/queue" not in cpu["metadata"]["labels"]
    await webhook.user.create(Pod.from_dict(pod_body("cpu-pod", gpus=0)), namespace=MANAGED)
    await webhook.user.create(JOB(job_body("elsewhere", suspend=False)), namespace=ELSEWHERE)


@pytest.mark.parametrize("kind", list(KINDS))
async def test_each_kind_is_sent_to_gpuq_when_any_template_asks_for_gpus(webhook: Webhook, kind: str) -> None:
    """Up: a GPU workload created running is suspended and queued, a CPU one is left alone. Down: the GPU one is
    refused (it was sent), the CPU one is created (it was not)."""
    resource = KINDS[kind]
    try:
        gpu = await webhook.user.create(resource(kind_body(kind, "gpu", gpu=True)), namespace=MANAGED)
    except ApiError as error:
        if error.status.code == 404:  # a real cluster without this kind's CRD
            pytest.skip(f"{kind} is not served by this cluster")
        raise
    assert suspended(gpu) and gpu["metadata"]["labels"]["gpuq.io/queue"] == "team-a"
    cpu = await webhook.user.create(resource(kind_body(kind, "cpu", gpu=False)), namespace=MANAGED)
    assert not suspended(cpu) and "gpuq.io/queue" not in (cpu["metadata"].get("labels") or {})
    await stop(webhook)
    error = await refused(webhook.user.create(resource(kind_body(kind, "gpu-down", gpu=True)), namespace=MANAGED))
    assert error.status.code == 500 and "failed calling webhook" in str(error.status.message)
    await webhook.user.create(resource(kind_body(kind, "cpu-down", gpu=False)), namespace=MANAGED)


@pytest.mark.parametrize("where", ["annotation", "label", "pod template label"])
async def test_a_gpuq_key_on_a_cpu_job_still_reaches_validation(webhook: Webhook, where: str) -> None:
    forged = {"gpuq.io/job-id": "ml-team-a.victim.0123abcd"}
    body = job_body("forged-cpu", gpus=0, suspend=True, annotations=forged if where == "annotation" else None,
                    labels=forged if where == "label" else None)
    if where == "pod template label":
        body["spec"]["template"]["metadata"] = {"labels": forged}
    error = await refused(webhook.user.create(JOB(body), namespace=MANAGED))
    assert error.status.code == 403 and "gpuq.io/job-id" in str(error.status.message)


async def test_removing_gpuqs_annotation_from_a_cpu_job_reaches_validation(webhook: Webhook) -> None:
    """Only the old object carries the key: the conditions read `oldObject` on updates."""
    body = job_body("stamped", gpus=0, suspend=True, annotations={"gpuq.io/job-id": "wh-team-a.stamped.0123abcd"})
    await webhook.gpuq.create(JOB(body), namespace=MANAGED)  # gpuq's own write
    error = await refused(webhook.user.patch(JOB, "stamped", {"metadata": {"annotations": {"gpuq.io/job-id": None}}},
                                             namespace=MANAGED, patch_type=PatchType.MERGE))
    assert error.status.code == 403 and "gpuq.io/job-id" in str(error.status.message)


async def test_gpuqs_ca_is_in_its_secret_and_both_caBundles_and_is_replaced_before_it_expires(
        webhook: Webhook) -> None:
    secret = await webhook.gpuq.get(Secret, "gpuq-webhook-tls", namespace=SYSTEM)
    first = CertPair.from_secret(secret.to_dict())
    assert first is not None
    bundles = [(await webhook.gpuq.get(res, webhook.name))["webhooks"] for res in (MUTATING, VALIDATING)]
    assert {w["clientConfig"]["caBundle"] for ws in bundles for w in ws} == {base64.b64encode(first.ca_pem).decode()}
    # Not yet due: nothing changes. Within renew_before of its expiry: a new CA and certificate.
    assert not await webhook.server.rotate_if_due()
    settings = webhook.server.settings  # a renewal window that the certificate has entered
    settings.renew_before = first.not_after - settings.now() + dt.timedelta(days=1)
    settings.validity = settings.renew_before + dt.timedelta(days=30)
    assert await webhook.server.rotate_if_due()
    assert not await webhook.server.rotate_if_due()
    second = CertPair.from_secret((await webhook.gpuq.get(Secret, "gpuq-webhook-tls", namespace=SYSTEM)).to_dict())
    assert second is not None and second.ca_pem != first.ca_pem and second.not_after > first.not_after
    for res in (MUTATING, VALIDATING):
        for w in (await webhook.gpuq.get(res, webhook.name))["webhooks"]:
            bundle = base64.b64decode(w["clientConfig"]["caBundle"])
            assert second.ca_pem in bundle and first.ca_pem in bundle  # the old CA kept through the switch
    created = await webhook.user.create(JOB(job_body("after-rotation", suspend=False)), namespace=MANAGED)
    assert created["spec"]["suspend"] is True  # served with the new certificate


async def test_a_plain_pod_labelled_with_a_queue_is_held_by_gpuqs_gate(webhook: Webhook) -> None:
    """Issue 48 item 1: a pod a user creates labelled gpuq.io/queue (no controller) is held by gpuq's scheduling gate
    and stamped with its user of record, whether or not it asks for GPUs; it cannot name another team's queue, and
    only gpuq removes the gate."""
    body = pod_body("plain")
    body["metadata"]["labels"] = {"gpuq.io/queue": "team-a", "gpuq.io/pod-group": "g"}
    body["metadata"]["annotations"] = {"gpuq.io/pod-group-total-count": "1"}
    created = (await webhook.user.create(Pod.from_dict(body), namespace=MANAGED)).to_dict()
    assert created["spec"]["schedulingGates"] == [{"name": "gpuq.io/placement"}]
    assert created["metadata"]["annotations"]["gpuq.io/user"] == webhook.username
    cpu = pod_body("plain-cpu", gpus=0)
    cpu["metadata"]["labels"] = {"gpuq.io/queue": "team-a"}
    held = (await webhook.user.create(Pod.from_dict(cpu), namespace=MANAGED)).to_dict()
    assert held["spec"]["schedulingGates"] == [{"name": "gpuq.io/placement"}]
    error = await refused(webhook.user.patch(Pod, "plain", {"spec": {"schedulingGates": []}}, namespace=MANAGED,
                                             patch_type=PatchType.MERGE))
    assert "only gpuq removes" in str(error.status.message)
    other = pod_body("plain-other")
    other["metadata"]["labels"] = {"gpuq.io/queue": "team-b"}
    error = await refused(webhook.user.create(Pod.from_dict(other), namespace=MANAGED))
    assert "queue 'team-b' is not open to namespace wh-team-a" in str(error.status.message)
