"""Watches as informers use them: resume from a resourceVersion, selectors, bookmarks, 410 Gone and relist, through
lightkube, kubernetes_asyncio and plain HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap
from lightkube.types import on_error_retry

from tests.kube.kubefake.cluster import KubeCluster

NS = "default"


def config_map(name: str, **labels: str) -> ConfigMap:
    return ConfigMap(metadata=ObjectMeta(name=name, namespace=NS, labels=dict(labels)), data={"v": "0"})


async def next_events(stream: AsyncIterator[Any], count: int, timeout_s: float = 5) -> list[Any]:
    events = []
    for _ in range(count):
        events.append(await asyncio.wait_for(anext(stream), timeout_s))
    return events


def raw_client(cluster: KubeCluster) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cluster.token}"} if cluster.token else {}
    return httpx.AsyncClient(base_url=cluster.server, headers=headers, timeout=httpx.Timeout(10, read=10))


async def raw_watch(cluster: KubeCluster, path: str, params: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """Read `count` events of one watch request, or fewer when the server ends it."""
    events: list[dict[str, Any]] = []
    async with raw_client(cluster) as raw, raw.stream("GET", path, params={"watch": "true", **params}) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            events.append(json.loads(line))
            if len(events) == count:
                break
    return events


async def test_a_watch_resumes_after_the_resource_version_it_is_given(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    await client.create(config_map("a"))
    await client.create(config_map("b"))
    listed = client.list(ConfigMap, namespace=NS)
    assert [c.metadata.name async for c in listed] == ["a", "b"]
    resume_from = listed.resourceVersion
    await client.create(config_map("c"))
    await client.patch(ConfigMap, "a", {"data": {"v": "1"}}, namespace=NS)
    await client.delete(ConfigMap, "b", namespace=NS)

    stream = aiter(client.watch(ConfigMap, namespace=NS, resource_version=resume_from))
    replayed = await next_events(stream, 3)
    assert [(kind, obj.metadata.name) for kind, obj in replayed] == [
        ("ADDED", "c"),
        ("MODIFIED", "a"),
        ("DELETED", "b"),
    ]
    versions = [int(obj.metadata.resourceVersion) for _, obj in replayed]
    assert versions == sorted(versions) and versions[0] > int(resume_from)
    await client.create(config_map("d"))
    [(kind, live)] = await next_events(stream, 1)
    assert (kind, live.metadata.name) == ("ADDED", "d")


async def test_a_watch_without_resource_version_starts_with_the_current_objects(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    await client.create(config_map("a"))
    stream = aiter(client.watch(ConfigMap, namespace=NS))
    [(kind, obj)] = await next_events(stream, 1)
    assert (kind, obj.metadata.name) == ("ADDED", "a")


async def test_a_selector_watch_sees_objects_leave_and_enter_the_selection(kube_api: KubeCluster) -> None:
    client = kube_api.client()
    await client.create(config_map("a", team="x"))
    await client.create(config_map("b", team="y"))
    stream = aiter(client.watch(ConfigMap, namespace=NS, labels={"team": "x"}))
    [(kind, obj)] = await next_events(stream, 1)
    assert (kind, obj.metadata.name) == ("ADDED", "a")
    await client.patch(ConfigMap, "a", {"metadata": {"labels": {"team": "y"}}}, namespace=NS)
    await client.patch(ConfigMap, "b", {"metadata": {"labels": {"team": "x"}}}, namespace=NS)
    moved = await next_events(stream, 2)
    assert [(k, o.metadata.name) for k, o in moved] == [("DELETED", "a"), ("ADDED", "b")]


async def test_compaction_ends_watches_with_410_and_lightkube_relists(kube_api: KubeCluster) -> None:
    store = kube_api.fake.store
    client = kube_api.client()
    await client.create(config_map("a"))
    listed = client.list(ConfigMap, namespace=NS)
    assert [c.metadata.name async for c in listed] == ["a"]
    stream = aiter(
        client.watch(ConfigMap, namespace=NS, resource_version=listed.resourceVersion, on_error=on_error_retry)
    )
    await client.create(config_map("b"))
    [(kind, obj)] = await next_events(stream, 1)
    assert (kind, obj.metadata.name) == ("ADDED", "b")
    store.compact()
    # lightkube resumes from b's resourceVersion, gets 410 Gone, and restarts from the current state: a relist.
    relisted = await next_events(stream, 2)
    assert sorted((k, o.metadata.name) for k, o in relisted) == [("ADDED", "a"), ("ADDED", "b")]


async def test_a_too_old_resource_version_is_a_410_error_event(kube_api: KubeCluster) -> None:
    store = kube_api.fake.store
    client = kube_api.client()
    old = (await client.create(config_map("a"))).metadata.resourceVersion
    await client.create(config_map("b"))
    store.compact(expire_watches=False)
    [event] = await raw_watch(kube_api, f"/api/v1/namespaces/{NS}/configmaps", {"resourceVersion": old}, 5)
    assert event["type"] == "ERROR"
    assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")
    assert "too old resource version" in event["object"]["message"]


async def test_bookmarks_and_initial_events_end(kube_api: KubeCluster) -> None:
    store = kube_api.fake.store
    client = kube_api.client()
    await client.create(config_map("a"))
    path = f"/api/v1/namespaces/{NS}/configmaps"
    task = asyncio.create_task(
        raw_watch(
            kube_api,
            path,
            {"allowWatchBookmarks": "true", "sendInitialEvents": "true", "resourceVersionMatch": "NotOlderThan"},
            3,
        )
    )
    while store.open_watches == 0:
        await asyncio.sleep(0.01)
    await client.create(config_map("b"))
    store.bookmark()
    added, initial_end, live = await asyncio.wait_for(task, 5)
    assert (added["type"], added["object"]["metadata"]["name"]) == ("ADDED", "a")
    assert initial_end["type"] == "BOOKMARK"
    assert initial_end["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert (live["type"], live["object"]["metadata"]["name"]) == ("ADDED", "b")


async def test_a_watch_ends_after_timeout_seconds(kube_api: KubeCluster) -> None:
    events = await asyncio.wait_for(
        raw_watch(
            kube_api, f"/api/v1/namespaces/{NS}/configmaps", {"timeoutSeconds": "1", "resourceVersion": "1"}, 100
        ),
        10,
    )
    assert all(e["type"] in ("ADDED", "MODIFIED") for e in events)


async def test_kubernetes_asyncio_watch_gets_bookmarks_and_a_410_after_compaction(
    kube_api: KubeCluster, kube_asyncio_api: k8s_client.ApiClient
) -> None:
    fake = kube_api.fake
    core = k8s_client.CoreV1Api(kube_asyncio_api)
    await core.create_namespaced_config_map(NS, {"metadata": {"name": "a"}, "data": {"v": "0"}})
    listed = await core.list_namespaced_config_map(NS)
    watcher = k8s_watch.Watch()
    stream = watcher.stream(
        core.list_namespaced_config_map,
        NS,
        resource_version=listed.metadata.resource_version,
        allow_watch_bookmarks=True,
        timeout_seconds=30,
    )
    await core.create_namespaced_config_map(NS, {"metadata": {"name": "b"}, "data": {"v": "0"}})
    added = await asyncio.wait_for(anext(stream), 5)
    assert (added["type"], added["object"].metadata.name) == ("ADDED", "b")
    fake.store.bookmark()
    bookmark = await asyncio.wait_for(anext(stream), 5)
    assert bookmark["type"] == "BOOKMARK"
    assert watcher.resource_version == str(fake.store.resource_version)
    # kubernetes_asyncio sends watch=True (capitalised); the fake takes it as a watch, not a list.
    watch_requests = [r for r in fake.http.api if r.params.get("watch")]
    assert watch_requests and watch_requests[0].params["watch"] == "True"
    fake.store.compact()
    with pytest.raises(ApiException) as expired:
        await asyncio.wait_for(anext(stream), 5)
    assert expired.value.status == 410
    await watcher.close()
