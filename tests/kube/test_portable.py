"""Tests that hold on the fake and on a real cluster alike: they touch no fake internals, and their pods run programs
a real node runs too. `make test-kube` runs them (and every other kube_api test) against GPUQ_KUBECONFIG;
test_real_cluster_mode.py runs this file that way against a fake posing as a real cluster."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import ConfigMap
from lightkube.types import PatchType

from tests.kube.kubefake.cluster import KubeCluster
from tests.kube.kubefake.resources import JOBS
from tests.kube.kubefake.store import get_condition


async def fresh_namespace(cluster: KubeCluster) -> str:
    await cluster.ensure_worker_node()
    return await cluster.create_namespace(f"kubefake-{uuid.uuid4().hex[:8]}")


def indexed_job(name: str, namespace: str, script: str) -> Job:
    container: dict[str, Any] = {
        "name": "main",
        "image": "busybox:1.36",
        "command": ["sh", "-c", script],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "100m", "memory": "32Mi"}},
    }
    spec = {
        "suspend": True,
        "completionMode": "Indexed",
        "completions": 2,
        "parallelism": 2,
        "backoffLimit": 0,
        "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
    }
    return Job.from_dict({"metadata": {"name": name, "namespace": namespace}, "spec": spec})


def complete(job: dict[str, Any]) -> bool:
    return (get_condition(job, "Complete") or {}).get("status") == "True"


def failed(job: dict[str, Any]) -> bool:
    return (get_condition(job, "Failed") or {}).get("status") == "True"


async def test_a_suspended_indexed_job_runs_once_unsuspended(kube_api: KubeCluster) -> None:
    namespace = await fresh_namespace(kube_api)
    client = kube_api.client()
    await client.create(indexed_job("j", namespace, "exit 0"))
    await kube_api.settle()
    assert await kube_api.pods(namespace) == []
    await client.patch(Job, "j", {"spec": {"suspend": False}}, namespace=namespace, patch_type=PatchType.MERGE)
    done = await kube_api.wait_for_object(JOBS, "j", namespace, complete, timeout_s=120)
    assert done["status"]["succeeded"] == 2 and done["status"]["completedIndexes"] == "0-1"


async def test_a_failing_container_fails_the_job_with_backoff_limit_exceeded(kube_api: KubeCluster) -> None:
    namespace = await fresh_namespace(kube_api)
    await kube_api.client().create(indexed_job("j", namespace, "exit 3"))
    await kube_api.client().patch(Job, "j", {"spec": {"suspend": False}}, namespace=namespace)
    done = await kube_api.wait_for_object(JOBS, "j", namespace, failed, timeout_s=120)
    assert (get_condition(done, "Failed") or {})["reason"] == "BackoffLimitExceeded"
    pods = await kube_api.pods(namespace, "batch.kubernetes.io/job-name=j")
    exit_codes = {
        s["state"]["terminated"]["exitCode"]
        for p in pods
        for s in p["status"].get("containerStatuses") or []
        if (s.get("state") or {}).get("terminated")
    }
    assert exit_codes == {3}


async def test_a_stale_update_conflicts_and_a_watch_resumes(kube_api: KubeCluster) -> None:
    namespace = await fresh_namespace(kube_api)
    client = kube_api.client()
    created = await client.create(ConfigMap(metadata=ObjectMeta(name="c", namespace=namespace), data={"v": "1"}))
    listed = client.list(ConfigMap, namespace=namespace)
    assert "c" in [c.metadata.name async for c in listed]
    await client.patch(ConfigMap, "c", {"data": {"v": "2"}}, namespace=namespace)
    created.data = {"v": "3"}
    with pytest.raises(ApiError) as stale:
        await client.replace(created)
    assert stale.value.status.code == 409
    stream = aiter(client.watch(ConfigMap, namespace=namespace, resource_version=listed.resourceVersion))
    kind, obj = await asyncio.wait_for(anext(stream), 30)
    assert (kind, obj.metadata.name, obj.data) == ("MODIFIED", "c", {"v": "2"})
