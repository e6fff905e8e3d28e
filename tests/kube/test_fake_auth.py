"""Identity and permissions on the API server, as gpuq's API (TokenReview) and its chart's RBAC rely on them:
ServiceAccount tokens from the TokenRequest API, TokenReview with audiences, and RBAC deciding a ServiceAccount's
requests. These tests hold on a real cluster too (GPUQ_KUBECONFIG), except those that need the fake's clock or
its user tokens."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.core_v1 import ConfigMap, Pod
from lightkube.resources.rbac_authorization_v1 import ClusterRole, ClusterRoleBinding, Role, RoleBinding

from tests.kube.kubefake.cluster import KubeCluster


async def review(cluster: KubeCluster, token: str, audiences: list[str] | None = None) -> Any:
    reviewed = await cluster.client().create(TokenReview(spec=TokenReviewSpec(token=token, audiences=audiences)))
    return reviewed.status


async def namespace_with_account(cluster: KubeCluster) -> str:
    ns = await cluster.create_namespace(f"auth-{uuid.uuid4().hex[:6]}")
    await cluster.create_service_account(ns, "trainer")
    return ns


async def test_token_review_says_whose_service_account_token_it_is_for_its_audiences(kube_api: KubeCluster) -> None:
    ns = await namespace_with_account(kube_api)
    token = await kube_api.service_account_token(ns, "trainer", audiences=("gpuq",))
    status = await review(kube_api, token, ["gpuq"])
    assert status.authenticated is True
    assert status.user.username == f"system:serviceaccount:{ns}:trainer"
    assert {"system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"} <= set(status.user.groups)
    assert status.audiences == ["gpuq"]
    # The same token is not valid for another audience, nor for the API server itself.
    assert (await review(kube_api, token, ["someone-else"])).authenticated is False
    assert (await review(kube_api, token)).authenticated is False
    # Nonsense is a status, not an error.
    unknown = await review(kube_api, "not-a-token", ["gpuq"])
    assert unknown.authenticated is False and unknown.error


async def test_a_deleted_service_accounts_tokens_stop_working(kube_api: KubeCluster) -> None:
    from lightkube.resources.core_v1 import ServiceAccount

    ns = await namespace_with_account(kube_api)
    token = await kube_api.service_account_token(ns, "trainer", audiences=("gpuq",))
    await kube_api.client().delete(ServiceAccount, "trainer", namespace=ns)
    await kube_api.wait_for("the token refused", lambda: _refused(kube_api, token))
    # Same name, new account: the old token stays dead (it was bound to the old uid).
    await kube_api.create_service_account(ns, "trainer")
    assert (await review(kube_api, token, ["gpuq"])).authenticated is False


async def _refused(cluster: KubeCluster, token: str) -> bool:
    return (await review(cluster, token, ["gpuq"])).authenticated is False


async def test_token_request_refuses_a_missing_account_and_too_short_a_life(kube_api: KubeCluster) -> None:
    ns = await namespace_with_account(kube_api)
    with pytest.raises(ApiError) as missing:
        await kube_api.service_account_token(ns, "nobody")
    assert missing.value.status.code == 404
    with pytest.raises(ApiError) as short:
        await kube_api.service_account_token(ns, "trainer", expiration_s=60)
    assert short.value.status.code == 422 and "10 minutes" in str(short.value.status.message)


async def test_tokens_expire_on_the_fake_clock(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    ns = await namespace_with_account(kube_api)
    token = await kube_api.service_account_token(ns, "trainer", audiences=("gpuq",), expiration_s=600)
    assert (await review(kube_api, token, ["gpuq"])).authenticated is True
    fake.advance(601)
    assert (await review(kube_api, token, ["gpuq"])).authenticated is False


async def test_user_tokens_carry_their_groups(kube_api: KubeCluster) -> None:
    token = kube_api.fake.http.api.auth.add_user_token("alice@example.com", ("platform-admins",), ("gpuq",))
    status = await review(kube_api, token, ["gpuq"])
    assert status.user.username == "alice@example.com"
    assert status.user.groups == ["platform-admins", "system:authenticated"]


async def test_rbac_decides_a_service_accounts_requests(kube_api: KubeCluster, tmp_path: Path) -> None:
    ns = await namespace_with_account(kube_api)
    admin = kube_api.client()
    await admin.create(Role.from_dict({"metadata": {"name": "pod-reader", "namespace": ns}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"], "resourceNames": ["allowed"]}]}))
    await admin.create(RoleBinding.from_dict({
        "metadata": {"name": "trainer-reads", "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "trainer", "namespace": ns}]}))
    role_name = f"node-lister-{ns}"
    await admin.create(ClusterRole.from_dict({"metadata": {"name": role_name}, "rules": [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]}))
    await admin.create(ClusterRoleBinding.from_dict({
        "metadata": {"name": role_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": "trainer", "namespace": ns}]}))
    try:
        token = await kube_api.service_account_token(ns, "trainer")
        async with AsyncClient(KubeConfig.from_file(kube_api.token_kubeconfig(token, tmp_path / "sa.yaml"))) as sa:
            assert [p async for p in sa.list(Pod, namespace=ns)] == []
            with pytest.raises(ApiError) as denied:
                await sa.delete(Pod, "any", namespace=ns)
            assert denied.value.status.code == 403
            assert (f'User "system:serviceaccount:{ns}:trainer" cannot delete resource "pods" in API group "" in the '
                    f'namespace "{ns}"') in str(denied.value.status.message)
            with pytest.raises(ApiError) as cluster_wide:  # a Role binds in its namespace only
                [p async for p in sa.list(Pod, namespace="*")]
            assert cluster_wide.value.status.code == 403 and "at the cluster scope" in str(
                cluster_wide.value.status.message)
            from lightkube.resources.core_v1 import Node

            [n async for n in sa.list(Node)]  # granted cluster-wide by the ClusterRoleBinding
            with pytest.raises(ApiError) as by_name:  # resourceNames: that one object only
                await sa.get(ConfigMap, "other", namespace=ns)
            assert by_name.value.status.code == 403
        async with AsyncClient(KubeConfig.from_file(kube_api.token_kubeconfig("nonsense", tmp_path / "x.yaml"))) as x:
            with pytest.raises(ApiError) as anonymous:
                await x.get(Pod, "any", namespace=ns)
            assert anonymous.value.status.code == 401
    finally:
        await admin.delete(ClusterRoleBinding, role_name)
        await admin.delete(ClusterRole, role_name)


async def test_the_access_log_tells_what_each_identity_did(kube_api: KubeCluster, tmp_path: Path) -> None:
    fake = kube_api.fake
    ns = await namespace_with_account(kube_api)
    await kube_api.client().create(ClusterRoleBinding.from_dict({
        "metadata": {"name": "trainer-admin"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "does-not-exist"},
        "subjects": [{"kind": "ServiceAccount", "name": "trainer", "namespace": ns}]}))
    token = await kube_api.service_account_token(ns, "trainer")
    async with AsyncClient(KubeConfig.from_file(kube_api.token_kubeconfig(token, tmp_path / "sa.yaml"))) as sa:
        with pytest.raises(ApiError):  # a binding to a missing role grants nothing
            await sa.get(Pod, "p", namespace=ns)
    user = f"system:serviceaccount:{ns}:trainer"
    assert fake.http.api.auth.used_by(user) == {}
    denied = [a for a in fake.http.api.auth.log if a.user == user]
    assert [(a.verb, a.resource, a.namespace, a.name, a.allowed) for a in denied] == [("get", "pods", ns, "p", False)]
