"""Scheduling gates, node fit, pods/binding, selectors, graceful deletion and the kubelet, on the fake cluster."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from tests.kube.kubefake.cluster import KubeCluster
from tests.kube.kubefake.resources import NODES, PODS
from tests.kube.kubefake.store import get_condition

NS = "default"
GATE = "gpuq.io/placement"


def gpu_pod(name: str, gpus: int = 8, gated: bool = False, **spec: Any) -> Pod:
    body: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{"name": "train", "image": "trainer:1", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
        **spec,
    }
    if gated:
        body["schedulingGates"] = [{"name": GATE}]
    return Pod.from_dict({"metadata": {"name": name, "namespace": NS, "labels": {"app": "train"}}, "spec": body})


async def test_a_gated_pod_stays_pending_until_its_gate_is_removed_then_binds_where_it_was_placed(
    kube_api: KubeCluster,
) -> None:
    fake = kube_api.fake
    for node in ("n1", "n2", "n3"):
        fake.add_node(node, gpus=8, gpu_product="NVIDIA-H100-80GB-HBM3")
    client = kube_api.client()
    await client.create(gpu_pod("p", gated=True))
    await fake.settle()
    pending = fake.store.get(PODS, NS, "p")
    assert "nodeName" not in pending["spec"] and pending["status"]["phase"] == "Pending"
    assert get_condition(pending, "PodScheduled") is not None
    assert (get_condition(pending, "PodScheduled") or {})["reason"] == "SchedulingGated"
    # The executor's placement: node restriction added while gated, then the gate removed.
    await client.patch(Pod, "p", {"spec": {"nodeSelector": {"kubernetes.io/hostname": "n3"}}}, namespace=NS)
    await client.patch(Pod, "p", {"spec": {"schedulingGates": [{"name": GATE, "$patch": "delete"}]}}, namespace=NS)
    ready = await kube_api.run_pods_to_ready(NS, "app=train")
    assert [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in ready] == [("p", "n3")]
    # Once ungated, the node restrictions are frozen like the rest of the spec.
    with pytest.raises(ApiError) as frozen:
        await client.patch(Pod, "p", {"spec": {"nodeSelector": {"rack": "r1"}}}, namespace=NS)
    assert frozen.value.status.code == 422


async def test_no_fit_leaves_the_pod_unschedulable_with_the_schedulers_reasons(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("small", gpus=4)
    fake.add_node("tainted", gpus=8, taints=[{"key": "dedicated", "value": "infer", "effect": "NoSchedule"}])
    fake.add_node("cpu-only")
    await kube_api.client().create(gpu_pod("p", gpus=8))
    await fake.settle()
    pod = fake.store.get(PODS, NS, "p")
    scheduled = get_condition(pod, "PodScheduled") or {}
    assert (scheduled.get("status"), scheduled.get("reason")) == ("False", "Unschedulable")
    assert scheduled["message"] == (
        "0/3 nodes are available: 2 Insufficient nvidia.com/gpu, 1 node(s) had untolerated taint {dedicated: infer}."
    )
    # A toleration makes the tainted node fit.
    await kube_api.client().create(
        gpu_pod(
            "tolerant",
            tolerations=[{"key": "dedicated", "operator": "Equal", "value": "infer", "effect": "NoSchedule"}],
        )
    )
    await fake.settle()
    assert fake.store.get(PODS, NS, "tolerant")["spec"]["nodeName"] == "tainted"


async def test_gpus_mig_slices_and_node_selectors_are_respected(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("a100", gpus=0, mig={"1g.10gb": 7}, labels={"pool": "mig"})
    fake.add_node("h100", gpus=8, labels={"pool": "train"})
    client = kube_api.client()
    mig = Pod.from_dict(
        {
            "metadata": {"name": "slice", "namespace": NS},
            "spec": {
                "containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}]
            },
        }
    )
    await client.create(mig)
    await client.create(gpu_pod("first", gpus=6, nodeSelector={"pool": "train"}))
    await client.create(gpu_pod("second", gpus=4, nodeSelector={"pool": "train"}))
    await fake.settle()
    assert fake.store.get(PODS, NS, "slice")["spec"]["nodeName"] == "a100"
    assert fake.store.get(PODS, NS, "first")["spec"]["nodeName"] == "h100"
    assert "nodeName" not in fake.store.get(PODS, NS, "second")["spec"]  # 6 + 4 > 8
    fake.kubelet.finish(NS, "first")
    await fake.settle()
    assert fake.store.get(PODS, NS, "second")["spec"]["nodeName"] == "h100"  # the finished pod freed its GPUs


async def test_pods_binding_replies_with_a_status_and_refuses_a_second_binding(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1", gpus=8)
    await kube_api.client().create(gpu_pod("p", schedulerName="gpuq"))
    await kube_api.client().create(gpu_pod("gated", gated=True, schedulerName="gpuq"))
    await fake.settle()
    assert "nodeName" not in fake.store.get(PODS, NS, "p")["spec"]  # another scheduler's pod: left alone
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "p"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
    }
    headers = {"Authorization": f"Bearer {kube_api.token}"}
    async with httpx.AsyncClient(base_url=kube_api.server, headers=headers) as raw:
        reply = await raw.post(f"/api/v1/namespaces/{NS}/pods/p/binding", json=binding)
        again = await raw.post(f"/api/v1/namespaces/{NS}/pods/p/binding", json=binding)
        gated = await raw.post(
            f"/api/v1/namespaces/{NS}/pods/gated/binding", json={**binding, "metadata": {"name": "gated"}}
        )
    assert reply.status_code == 201
    assert reply.json() == {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success", "code": 201}
    assert fake.store.get(PODS, NS, "p")["spec"]["nodeName"] == "n1"
    assert again.status_code == 409 and "already assigned" in again.json()["message"]
    assert gated.status_code == 409 and "schedulingGates" in gated.json()["message"]


async def test_label_and_field_selectors(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1", gpus=8)
    client = kube_api.client()
    await client.create(
        Pod.from_dict(
            {
                "metadata": {"name": "a", "namespace": NS, "labels": {"tier": "gold", "team": "x"}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            }
        )
    )
    await client.create(
        Pod.from_dict(
            {
                "metadata": {"name": "b", "namespace": NS, "labels": {"tier": "silver"}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            }
        )
    )
    await client.create(
        Pod.from_dict(
            {
                "metadata": {"name": "c", "namespace": "kube-system", "labels": {"tier": "gold"}},
                "spec": {"containers": [{"name": "c", "image": "i"}], "schedulingGates": [{"name": GATE}]},
            }
        )
    )
    await fake.settle()

    async def names(**kwargs: Any) -> list[str]:
        return sorted([p.metadata.name async for p in client.list(Pod, namespace="*", **kwargs)])

    assert await names(labels={"tier": "gold"}) == ["a", "c"]
    async with httpx.AsyncClient(
        base_url=kube_api.server, headers={"Authorization": f"Bearer {kube_api.token}"}
    ) as raw:

        async def raw_names(**params: str) -> list[str]:
            reply = await raw.get("/api/v1/pods", params=params)
            assert reply.status_code == 200, reply.text
            return sorted(i["metadata"]["name"] for i in reply.json()["items"])

        assert await raw_names(labelSelector="tier in (gold,silver),team") == ["a"]
        assert await raw_names(labelSelector="tier notin (gold),!team") == ["b"]
        assert await raw_names(labelSelector="tier!=gold") == ["b"]
        assert await raw_names(fieldSelector="spec.nodeName=n1") == ["a", "b"]
        assert await raw_names(fieldSelector="spec.nodeName=") == ["c"]
        assert await raw_names(fieldSelector="metadata.namespace!=default,metadata.name=c") == ["c"]
        bad = await raw.get("/api/v1/pods", params={"fieldSelector": "spec.priority=1"})
        assert bad.status_code == 400 and bad.json()["message"] == "field label not supported: spec.priority"
        nodes = await raw.get("/api/v1/nodes", params={"fieldSelector": "metadata.name=n1"})
        assert [n["metadata"]["name"] for n in nodes.json()["items"]] == ["n1"]


async def test_graceful_deletion_keeps_a_running_pod_terminating_until_the_kubelet_stops_it(
    kube_api: KubeCluster,
) -> None:
    fake = kube_api.fake
    fake.add_node("n1", gpus=8)
    client = kube_api.client()
    await client.create(gpu_pod("running", terminationGracePeriodSeconds=45))
    await client.create(gpu_pod("unbound", nodeSelector={"kubernetes.io/hostname": "nowhere"}))
    await kube_api.run_pods_to_ready(NS, count=1)
    fake.kubelet.hold_terminations = True
    await client.delete(Pod, "running", namespace=NS)
    await client.delete(Pod, "unbound", namespace=NS)
    assert fake.store.find(PODS, NS, "unbound") is None  # never scheduled: nothing to stop, gone at once
    terminating = fake.store.get(PODS, NS, "running")
    assert terminating["metadata"]["deletionGracePeriodSeconds"] == 45
    assert terminating["metadata"]["deletionTimestamp"]
    await fake.settle()
    assert fake.store.find(PODS, NS, "running") is not None  # the kubelet holds it for its grace period
    fake.advance(45)
    assert fake.store.find(PODS, NS, "running") is None


async def test_finalizers_hold_a_deleted_object_until_removed(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    body = gpu_pod("held").to_dict()
    body["metadata"]["finalizers"] = ["example.com/hold"]
    await client.create(Pod.from_dict(body))
    await client.delete(Pod, "held", namespace=NS)
    held = await client.get(Pod, "held", namespace=NS)
    assert held.metadata.deletionTimestamp is not None
    await client.patch(Pod, "held", {"metadata": {"finalizers": None}}, namespace=NS, patch_type=PatchType.MERGE)
    with pytest.raises(ApiError) as gone:
        await client.get(Pod, "held", namespace=NS)
    assert gone.value.status.code == 404


async def test_kubelet_outcomes_oom_image_pull_and_eviction(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1", gpus=8)
    fake.kubelet.unpullable_images.add("registry.invalid/missing:1")
    client = kube_api.client()
    await client.create(gpu_pod("oom", gpus=1))
    await client.create(gpu_pod("evicted", gpus=1))
    bad = gpu_pod("pull", gpus=1).to_dict()
    bad["spec"]["containers"][0]["image"] = "registry.invalid/missing:1"
    await client.create(Pod.from_dict(bad))
    await kube_api.run_pods_to_ready(NS, count=2)
    fake.kubelet.oom_kill(NS, "oom")
    fake.kubelet.evict(NS, "evicted")
    await fake.settle()
    oom = fake.store.get(PODS, NS, "oom")
    assert oom["status"]["phase"] == "Failed"
    assert oom["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "OOMKilled"
    assert oom["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137
    evicted = fake.store.get(PODS, NS, "evicted")
    assert (evicted["status"]["phase"], evicted["status"]["reason"]) == ("Failed", "Evicted")
    pulling = fake.store.get(PODS, NS, "pull")
    assert pulling["status"]["phase"] == "Pending"
    assert pulling["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "ImagePullBackOff"


async def test_a_not_ready_node_taints_itself_and_its_pods_are_evicted_after_300s(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1", gpus=8)
    await kube_api.client().create(gpu_pod("p"))
    await kube_api.run_pods_to_ready(NS)
    fake.kubelet.set_node_ready("n1", False)
    await fake.settle()
    node = fake.store.get(NODES, None, "n1")
    assert {(t["key"], t["effect"]) for t in node["spec"]["taints"]} == {
        ("node.kubernetes.io/not-ready", "NoSchedule"),
        ("node.kubernetes.io/not-ready", "NoExecute"),
    }
    pod = fake.store.get(PODS, NS, "p")
    assert (get_condition(pod, "Ready") or {})["status"] == "False" and not pod["metadata"].get("deletionTimestamp")
    fake.advance(290)  # the fake clock follows the wall clock too: leave room for the seconds this test takes
    assert not fake.store.get(PODS, NS, "p")["metadata"].get("deletionTimestamp")
    fake.advance(10)  # the default 300 s toleration of not-ready:NoExecute has run out
    assert fake.store.find(PODS, NS, "p") is None
    fake.kubelet.set_node_ready("n1", True)
    assert "taints" not in fake.store.get(NODES, None, "n1")["spec"]
