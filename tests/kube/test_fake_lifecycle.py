"""Events in both APIs, namespace deletion, garbage collection, eviction, watch clean-up, autopilot, and the fake
through kubernetes_asyncio (including the pods/binding reply every Python client fails to parse)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from kubernetes_asyncio import client as k8s_client
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import ConfigMap, Event, Namespace, Pod
from lightkube.resources.events_v1 import Event as EventV1
from lightkube.types import CascadeType

from tests.kube.kubefake.cluster import KubeCluster
from tests.kube.kubefake.resources import JOBS, NAMESPACES, NEW_EVENTS, PODS

NS = "team-a"


def pod(name: str, namespace: str = NS, **spec: Any) -> Pod:
    body = {"restartPolicy": "Never", "containers": [{"name": "main", "image": "busybox"}], **spec}
    return Pod.from_dict({"metadata": {"name": name, "namespace": namespace, "labels": {"app": "x"}}, "spec": body})


async def test_an_event_created_through_either_api_is_read_through_both(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    await kube_api.create_namespace(NS)
    regarding = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "pt", "namespace": NS, "uid": "u1"}
    new_style = EventV1.from_dict(
        {
            "metadata": {"name": "pt.pending", "namespace": NS},
            "eventTime": "2025-01-01T00:00:00.000000Z",
            "reportingController": "gpuq.io/executor",
            "reportingInstance": "executor-0",
            "action": "Queue",
            "reason": "Pending",
            "note": "position 3 in queue research, ETA 12m",
            "type": "Normal",
            "regarding": regarding,
        }
    )
    await client.create(new_style)
    core = [e async for e in client.list(Event, namespace=NS, fields={"involvedObject.name": "pt"})]
    assert [(e.reason, e.message, e.involvedObject.kind, e.reportingComponent) for e in core] == [
        ("Pending", "position 3 in queue research, ETA 12m", "PyTorchJob", "gpuq.io/executor")
    ]
    old_style = Event.from_dict(
        {
            "metadata": {"name": "pt.placed", "namespace": NS},
            "involvedObject": regarding,
            "reason": "Placed",
            "message": "placed on node-1, node-2",
            "type": "Normal",
            "source": {"component": "gpuq"},
            "count": 1,
        }
    )
    await client.create(old_style)
    # Read through events.k8s.io/v1 as plain JSON: an Event created through core/v1 without eventTime reads back
    # with eventTime null, which lightkube's events/v1 model does not accept.
    headers = {"Authorization": f"Bearer {kube_api.token}"}
    async with httpx.AsyncClient(base_url=kube_api.server, headers=headers) as raw:
        both = (await raw.get(f"/apis/events.k8s.io/v1/namespaces/{NS}/events")).json()["items"]
    assert sorted((e["reason"], e["note"], e["regarding"]["name"]) for e in both) == [
        ("Pending", "position 3 in queue research, ETA 12m", "pt"),
        ("Placed", "placed on node-1, node-2", "pt"),
    ]
    await client.delete(Event, "pt.pending", namespace=NS)
    assert [e.metadata.name async for e in client.list(Event, namespace=NS)] == ["pt.placed"]
    assert await kube_api.read(NEW_EVENTS, "pt.pending", NS) is None


async def test_events_k8s_io_requires_its_fields_and_an_event_stays_in_its_namespace(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    await kube_api.create_namespace(NS)
    headers = {"Authorization": f"Bearer {kube_api.token}"}
    async with httpx.AsyncClient(base_url=kube_api.server, headers=headers) as raw:
        missing = await raw.post(
            f"/apis/events.k8s.io/v1/namespaces/{NS}/events", json={"metadata": {"name": "e"}, "reason": "Pending"}
        )
    assert missing.status_code == 422
    assert "eventTime: Required value" in missing.json()["message"]
    with pytest.raises(ApiError) as elsewhere:
        await client.create(
            Event.from_dict(
                {
                    "metadata": {"name": "e", "namespace": NS},
                    "involvedObject": {"kind": "Pod", "name": "p", "namespace": "default"},
                    "reason": "X",
                }
            )
        )
    assert elsewhere.value.status.code == 422


async def test_deleting_a_namespace_removes_its_contents_and_refuses_new_ones_meanwhile(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1")
    client = kube_api.client()
    await kube_api.create_namespace(NS)
    await client.create(pod("running"))
    await client.create(ConfigMap(metadata=ObjectMeta(name="c", namespace=NS)))
    await kube_api.run_pods_to_ready(NS)
    fake.kubelet.hold_terminations = True
    await client.delete(Namespace, NS)
    terminating = fake.store.get(NAMESPACES, None, NS)
    assert terminating["status"]["phase"] == "Terminating"
    assert fake.store.list(PODS, NS)[0]["metadata"]["deletionTimestamp"]  # the pod waits for its kubelet
    with pytest.raises(ApiError) as refused:
        await client.create(ConfigMap(metadata=ObjectMeta(name="late", namespace=NS)))
    assert refused.value.status.code == 403
    fake.kubelet.hold_terminations = False
    await fake.settle()
    assert fake.store.find(NAMESPACES, None, NS) is None


async def test_garbage_collection_of_a_jobs_pods_depends_on_the_propagation_policy(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1")
    client = kube_api.client()
    await kube_api.create_namespace(NS)
    template = {"spec": {"restartPolicy": "Never", "containers": [{"name": "m", "image": "x"}]}}
    for name in ("orphaned", "collected"):
        await client.create(
            Job.from_dict({"metadata": {"name": name, "namespace": NS}, "spec": {"template": template}})
        )
    await kube_api.run_pods_to_ready(NS, count=2)
    await client.delete(Job, "orphaned", namespace=NS)  # no propagationPolicy: batch/v1 Jobs orphan their pods
    await client.delete(Job, "collected", namespace=NS, cascade=CascadeType.BACKGROUND)
    await fake.settle()
    assert fake.store.list(JOBS, NS) == []
    [left] = fake.store.list(PODS, NS)
    assert left["metadata"]["labels"]["job-name"] == "orphaned"
    assert not left["metadata"].get("ownerReferences")


async def test_the_eviction_subresource_deletes_gracefully(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1")
    await kube_api.create_namespace(NS)
    await kube_api.client().create(pod("p"))
    await kube_api.run_pods_to_ready(NS)
    fake.kubelet.hold_terminations = True
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "p", "namespace": NS}}
    reply = await kube_api.client()._client._client.post(  # lightkube has no typed eviction helper for async
        f"/api/v1/namespaces/{NS}/pods/p/eviction", json=eviction
    )
    assert reply.status_code == 201 and reply.json()["status"] == "Success"
    assert fake.store.get(PODS, NS, "p")["metadata"]["deletionGracePeriodSeconds"] == 30


async def test_a_watch_whose_client_went_away_is_closed(kube_api: KubeCluster) -> None:
    store = kube_api.fake.store
    client = kube_api.client()
    stream = client.watch(ConfigMap, namespace="default")
    consumer = asyncio.create_task(anext(aiter(stream)))
    while store.open_watches == 0:
        await asyncio.sleep(0.01)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await stream.aclose()
    await kube_api.client().close()
    for _ in range(100):
        if store.open_watches == 0:
            break
        await asyncio.sleep(0.05)
    assert store.open_watches == 0


async def test_autopilot_runs_the_actors_after_every_change(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1", gpus=8)
    await kube_api.create_namespace(NS)
    template = {"spec": {"restartPolicy": "Never", "containers": [{"name": "m", "image": "x"}]}}
    async with kube_api.autopilot():
        await kube_api.client().create(
            Job.from_dict({"metadata": {"name": "j", "namespace": NS}, "spec": {"template": template}})
        )
        for _ in range(100):  # no settle() call: the fake reacts by itself
            pods = fake.store.list(PODS, NS)
            if pods and pods[0]["status"]["phase"] == "Running":
                break
            await asyncio.sleep(0.01)
    assert [p["status"]["phase"] for p in fake.store.list(PODS, NS)] == ["Running"]


async def test_kubernetes_asyncio_crud_conflict_and_the_binding_reply(
    kube_api: KubeCluster, kube_asyncio_api: k8s_client.ApiClient
) -> None:
    fake = kube_api.fake
    fake.add_node("n1")
    core = k8s_client.CoreV1Api(kube_asyncio_api)
    body = {"metadata": {"name": "p"}, "spec": {"schedulerName": "gpuq", "containers": [{"name": "m", "image": "x"}]}}
    created = await core.create_namespaced_pod("default", body)
    assert created.metadata.uid and created.metadata.resource_version
    with pytest.raises(k8s_client.ApiException) as exists:
        await core.create_namespaced_pod("default", body)
    assert exists.value.status == 409
    patched = await core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"a": "b"}}})
    assert patched.metadata.labels == {"a": "b"}
    stale = created.to_dict()
    stale["metadata"]["labels"] = {"c": "d"}
    with pytest.raises(k8s_client.ApiException) as conflict:
        await core.replace_namespaced_pod("p", "default", kube_asyncio_api.sanitize_for_serialization(created))
    assert conflict.value.status == 409
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "p"},
        "target": {"kind": "Node", "name": "n1"},
    }
    # The server answers 201 with a Status; the client tries to read it as a Binding and fails. The binding happened.
    with pytest.raises(ValueError, match="target"):
        await core.create_namespaced_pod_binding("p", "default", binding)
    assert fake.store.get(PODS, "default", "p")["spec"]["nodeName"] == "n1"
