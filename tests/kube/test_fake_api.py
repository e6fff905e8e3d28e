"""The fake API server's object semantics, through lightkube and plain HTTP: metadata stamping, conflicts, the status
subresource, patches, discovery, Status error bodies."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import ConfigMap, Pod
from lightkube.types import PatchType

from tests.kube.kubefake.cluster import KubeCluster
from tests.kube.kubefake.kinds import PyTorchJob


def pod(name: str, namespace: str = "default", **spec: Any) -> Pod:
    body = {"containers": [{"name": "main", "image": "busybox"}], **spec}
    return Pod.from_dict({"metadata": {"name": name, "namespace": namespace}, "spec": body})


def http(cluster: KubeCluster) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cluster.token}"} if cluster.token else {}
    return httpx.AsyncClient(base_url=cluster.server, headers=headers)


async def test_create_stamps_identity_and_a_cluster_wide_monotonic_resource_version(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    first = await client.create(pod("a"))
    config = await client.create(ConfigMap(metadata=ObjectMeta(name="c", namespace="default"), data={"k": "v"}))
    second = await client.create(pod("b"))
    assert first.metadata.uid and second.metadata.uid and first.metadata.uid != second.metadata.uid
    assert first.metadata.creationTimestamp is not None
    assert first.metadata.generation == 1
    versions = [int(o.metadata.resourceVersion) for o in (first, config, second)]
    assert versions == sorted(versions) and len(set(versions)) == 3
    assert first.status.phase == "Pending"


async def test_errors_are_status_objects_with_the_real_reasons(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    with pytest.raises(ApiError) as missing:
        await client.get(Pod, "nope", namespace="default")
    assert (missing.value.status.code, missing.value.status.reason) == (404, "NotFound")
    assert missing.value.status.message == 'pods "nope" not found'

    await client.create(pod("a"))
    with pytest.raises(ApiError) as exists:
        await client.create(pod("a"))
    assert (exists.value.status.code, exists.value.status.reason) == (409, "AlreadyExists")

    with pytest.raises(ApiError) as no_namespace:
        await client.create(pod("a", namespace="missing"))
    assert no_namespace.value.status.code == 404
    assert 'namespaces "missing" not found' in no_namespace.value.status.message


async def test_update_with_a_stale_resource_version_is_a_conflict(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    created = await client.create(ConfigMap(metadata=ObjectMeta(name="c", namespace="default"), data={"v": "1"}))
    created.data = {"v": "2"}
    updated = await client.replace(created)
    assert updated.data == {"v": "2"}
    assert int(updated.metadata.resourceVersion) > int(created.metadata.resourceVersion)
    created.data = {"v": "3"}  # still carries the old resourceVersion
    with pytest.raises(ApiError) as stale:
        await client.replace(created)
    assert (stale.value.status.code, stale.value.status.reason) == (409, "Conflict")
    assert "the object has been modified" in stale.value.status.message
    # A merge patch that names a resourceVersion is a precondition too.
    with pytest.raises(ApiError):
        await client.patch(
            ConfigMap,
            "c",
            {"metadata": {"resourceVersion": created.metadata.resourceVersion}, "data": {"v": "4"}},
            namespace="default",
            patch_type=PatchType.MERGE,
        )
    assert (await client.get(ConfigMap, "c", namespace="default")).data == {"v": "2"}


async def test_generation_moves_with_the_spec_only_and_status_is_its_own_subresource(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    job = Job.from_dict(
        {
            "metadata": {"name": "j", "namespace": "default"},
            "spec": {
                "suspend": True,
                "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "m", "image": "x"}]}},
            },
        }
    )
    created = await client.create(job)
    labelled = await client.patch(Job, "j", {"metadata": {"labels": {"a": "b"}}}, namespace="default")
    assert labelled.metadata.generation == 1
    unsuspended = await client.patch(Job, "j", {"spec": {"suspend": False}}, namespace="default")
    assert unsuspended.metadata.generation == 2
    # The main resource ignores status; the status subresource ignores everything else.
    ignored = await client.patch(Job, "j", {"status": {"active": 5}}, namespace="default", patch_type=PatchType.MERGE)
    assert ignored.status is None or not ignored.status.active
    written = await client.patch(
        Job.Status,
        "j",
        {"status": {"active": 5}, "spec": {"parallelism": 9}},
        namespace="default",
        patch_type=PatchType.MERGE,
    )
    assert written.status.active == 5 and written.spec.parallelism == 1
    assert created.metadata.uid == written.metadata.uid


async def test_scheduling_gate_removal_by_strategic_merge_json_patch_and_merge_patch(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    gates = [{"name": "gpuq.io/placement"}, {"name": "other"}]
    for name in ("smp", "json", "merge"):
        await client.create(pod(name, schedulingGates=gates))
    smp = await client.patch(
        Pod,
        "smp",
        {"spec": {"schedulingGates": [{"name": "gpuq.io/placement", "$patch": "delete"}]}},
        namespace="default",
        patch_type=PatchType.STRATEGIC,
    )
    assert [g.name for g in smp.spec.schedulingGates] == ["other"]
    json_patched = await client.patch(
        Pod,
        "json",
        [{"op": "remove", "path": "/spec/schedulingGates/0"}],
        namespace="default",
        patch_type=PatchType.JSON,
    )
    assert [g.name for g in json_patched.spec.schedulingGates] == ["other"]
    merged = await client.patch(
        Pod, "merge", {"spec": {"schedulingGates": None}}, namespace="default", patch_type=PatchType.MERGE
    )
    assert not merged.spec.schedulingGates
    # Adding a gate back is forbidden, as in the real API.
    with pytest.raises(ApiError) as added:
        await client.patch(
            Pod,
            "merge",
            {"spec": {"schedulingGates": [{"name": "late"}]}},
            namespace="default",
            patch_type=PatchType.MERGE,
        )
    assert (added.value.status.code, added.value.status.reason) == (422, "Invalid")


async def test_strategic_merge_merges_lists_by_their_merge_key(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    await client.create(pod("p", containers=[{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]))
    patched = await client.patch(
        Pod,
        "p",
        {"spec": {"containers": [{"name": "b", "image": "z"}]}},
        namespace="default",
        patch_type=PatchType.STRATEGIC,
    )
    assert [(c.name, c.image) for c in patched.spec.containers] == [("a", "x"), ("b", "z")]


async def test_a_suspended_jobs_template_takes_scheduling_directives_but_not_env(kube_api: KubeCluster) -> None:
    """Kubernetes' "mutable scheduling directives" for suspended Jobs: nodeSelector, tolerations, affinity,
    schedulingGates, labels and annotations of the template may change while the Job is suspended and has never
    started; anything else (env, image, resources) is immutable."""
    client = kube_api.client()
    await client.create(
        Job.from_dict(
            {
                "metadata": {"name": "j", "namespace": "default"},
                "spec": {
                    "suspend": True,
                    "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "a", "image": "x"}]}},
                },
            }
        )
    )
    placement = {
        "spec": {
            "template": {
                "metadata": {"annotations": {"gpuq.io/resume-from": "s3://ckpt"}},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": "n1"},
                    "tolerations": [{"key": "gpu", "operator": "Exists"}],
                    "schedulingGates": [{"name": "gpuq.io/placement"}],
                },
            }
        }
    }
    placed = await client.patch(Job, "j", placement, namespace="default", patch_type=PatchType.STRATEGIC)
    assert placed.spec.template.spec.nodeSelector == {"kubernetes.io/hostname": "n1"}
    assert [g.name for g in placed.spec.template.spec.schedulingGates] == ["gpuq.io/placement"]
    env = {
        "spec": {
            "template": {
                "spec": {"containers": [{"name": "a", "env": [{"name": "GPUQ_RESUME_FROM", "value": "s3://ckpt"}]}]}
            }
        }
    }
    with pytest.raises(ApiError) as refused:
        await client.patch(Job, "j", env, namespace="default", patch_type=PatchType.STRATEGIC)
    assert refused.value.status.code == 422 and "field is immutable" in refused.value.status.message


async def test_custom_resources_refuse_strategic_merge_patch_but_take_merge_patch(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    body = {
        "metadata": {"name": "pt", "namespace": "default"},
        "spec": {"runPolicy": {"suspend": True}, "pytorchReplicaSpecs": {}},
    }
    await client.create(PyTorchJob.from_dict(body))
    with pytest.raises(ApiError) as refused:
        await client.patch(
            PyTorchJob,
            "pt",
            {"spec": {"runPolicy": {"suspend": False}}},
            namespace="default",
            patch_type=PatchType.STRATEGIC,
        )
    assert refused.value.status.code == 415
    merged = await client.patch(
        PyTorchJob, "pt", {"spec": {"runPolicy": {"suspend": False}}}, namespace="default", patch_type=PatchType.MERGE
    )
    assert merged.spec["runPolicy"]["suspend"] is False


async def test_server_side_apply_creates_then_merges(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    config = ConfigMap(metadata=ObjectMeta(name="applied", namespace="default"), data={"a": "1"})
    created = await client.apply(config, field_manager="gpuq")
    assert created.data == {"a": "1"}
    config.data = {"b": "2"}
    updated = await client.apply(config, field_manager="gpuq")
    assert updated.data == {"a": "1", "b": "2"}  # approximate: no field ownership, so "a" stays
    async with http(kube_api) as raw:
        refused = await raw.patch(
            "/api/v1/namespaces/default/configmaps/applied",
            content=b"{}",
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
    assert refused.status_code == 400 and "fieldManager" in refused.json()["message"]


async def test_discovery_lists_core_batch_and_the_training_crds(kube_api: KubeCluster) -> None:
    async with http(kube_api) as raw:
        groups = (await raw.get("/apis")).json()
        core = (await raw.get("/api/v1")).json()
        kubeflow = (await raw.get("/apis/kubeflow.org/v1")).json()
        crds = (await raw.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions")).json()
    names = {g["name"] for g in groups["groups"]}
    assert {"batch", "jobset.x-k8s.io", "kubeflow.org", "ray.io", "events.k8s.io"} <= names
    core_names = {r["name"] for r in core["resources"]}
    assert {"pods", "pods/binding", "pods/status", "nodes", "namespaces", "events"} <= core_names
    pytorch = next(r for r in kubeflow["resources"] if r["name"] == "pytorchjobs")
    assert pytorch["kind"] == "PyTorchJob" and pytorch["namespaced"] is True
    assert {i["metadata"]["name"] for i in crds["items"]} == {
        "jobsets.jobset.x-k8s.io",
        "pytorchjobs.kubeflow.org",
        "tfjobs.kubeflow.org",
        "mpijobs.kubeflow.org",
        "rayjobs.ray.io",
        "rayclusters.ray.io",
        "notebooks.kubeflow.org",
        "leaderworkersets.leaderworkerset.x-k8s.io",
        "provisioningrequests.autoscaling.x-k8s.io",
    }


async def test_a_request_without_the_token_is_unauthorized(kube_api: KubeCluster) -> None:
    if not kube_api.is_fake:
        pytest.skip("the fake's own token check")
    async with httpx.AsyncClient(base_url=kube_api.server) as anonymous:
        reply = await anonymous.get("/api/v1/namespaces/default/pods")
    assert reply.status_code == 401 and reply.json()["reason"] == "Unauthorized"


async def test_list_pages_with_limit_and_continue(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    for i in range(5):
        await client.create(ConfigMap(metadata=ObjectMeta(name=f"c{i}", namespace="default")))
    async with http(kube_api) as raw:
        first = (await raw.get("/api/v1/namespaces/default/configmaps", params={"limit": 2})).json()
        second = (
            await raw.get(
                "/api/v1/namespaces/default/configmaps", params={"limit": 2, "continue": first["metadata"]["continue"]}
            )
        ).json()
    assert [i["metadata"]["name"] for i in first["items"]] == ["c0", "c1"]
    assert [i["metadata"]["name"] for i in second["items"]] == ["c2", "c3"]
    assert first["metadata"]["remainingItemCount"] == 3
    every = [c.metadata.name async for c in AsyncClient.list(client, ConfigMap, namespace="default", chunk_size=2)]
    assert every == [f"c{i}" for i in range(5)]
