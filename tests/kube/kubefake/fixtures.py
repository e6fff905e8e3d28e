"""pytest fixtures for Kubernetes tests (loaded for the whole suite by tests/conftest.py).

How a test gets a cluster:

    async def test_something(kube_api: KubeCluster) -> None:
        kube_api.kubeconfig   # Path of a kubeconfig file for any client (lightkube, kubernetes_asyncio, kubectl)
        kube_api.server       # base URL, e.g. http://127.0.0.1:41234
        kube_api.token        # bearer token the server requires (None on a real cluster using other credentials)
        kube_api.client()     # a lightkube AsyncClient on it
    async def test_other(kube_asyncio_api: kubernetes_asyncio.client.ApiClient) -> None:  # the same cluster
        kube_api.fake         # FakeCluster: store, scheduler, kubelet, controllers, clock, add_node(), advance(),
                              # settle_now(); skips the test when GPUQ_KUBECONFIG points at a real cluster

In code under test: `lightkube.KubeConfig.from_file(kube_api.kubeconfig)` or
`kubernetes_asyncio.config.load_kube_config(config_file=str(kube_api.kubeconfig))`.

Without GPUQ_KUBECONFIG every test gets its own fake API server on a free local port. With GPUQ_KUBECONFIG set, the
same fixture yields that real cluster, and the helpers wait for the real kubelet and controllers instead of
driving fake ones. Every test that uses `kube_api` carries the `kube` marker (`make test-kube` selects them)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from .cluster import FakeCluster, KubeCluster, RealCluster
from .server import FakeKubeServer

KUBECONFIG_ENV = "GPUQ_KUBECONFIG"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kube: uses a Kubernetes API server (the fake, or GPUQ_KUBECONFIG's cluster)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "kube_api" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kube)


@pytest_asyncio.fixture
async def kube_api(tmp_path: Path) -> AsyncIterator[KubeCluster]:
    """A Kubernetes API server for one test: a fresh fake, or the real cluster of GPUQ_KUBECONFIG."""
    real = os.environ.get(KUBECONFIG_ENV)
    if real:
        path = Path(real).expanduser()
        if not path.is_file():
            raise pytest.UsageError(f"{KUBECONFIG_ENV}={real} is not a kubeconfig file")
        cluster: KubeCluster = RealCluster(path)
        try:
            yield cluster
        finally:
            await cluster.cleanup()
            await cluster.close()
        return
    async with FakeKubeServer(tmp_path) as server:
        fake = FakeCluster(server)
        try:
            yield fake
        finally:
            await fake.close()


@pytest_asyncio.fixture
async def kube_asyncio_api(kube_api: KubeCluster) -> AsyncIterator[k8s_client.ApiClient]:
    """A kubernetes_asyncio ApiClient configured from kube_api's kubeconfig."""
    configuration = k8s_client.Configuration()
    await k8s_config.load_kube_config(config_file=str(kube_api.kubeconfig), client_configuration=configuration)
    async with k8s_client.ApiClient(configuration) as api:
        yield api
