"""Kubernetes tokens in place of API tokens (GPUQ_API_TOKEN_REVIEW): the API asks the API server (the fake of
tests/kube/kubefake, through its real TokenReview endpoint) who a token belongs to. A pipeline's ServiceAccount acts
for the team its namespace is mapped to, a user for its `gpuq:team:<team>` group, an admin group's member as an
admin; tokens made for another audience, unmapped namespaces and strangers are refused, and gpuq's own tokens keep
working beside them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import pytest_asyncio

from shared.config import NamespaceMapping
from tests.kube.kubefake.cluster import KubeCluster
from tests.service.security.conftest import ApiPlatform, AuthServer, api_platform, bearer, wait_for
from tests.service.security.test_attacks import CLUSTER, QUEUES, job

NAMESPACES = (NamespaceMapping(name="ml-team-a", team="team-a", queues=("team-a",)),
              NamespaceMapping(name="ml-team-b", team="team-b", queues=("team-b",)))


@pytest_asyncio.fixture
async def platform(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]], kube_api: KubeCluster,
                   monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ApiPlatform]:
    monkeypatch.setenv("GPUQ_API_TOKEN_REVIEW", "true")
    monkeypatch.setenv("GPUQ_API_TOKEN_AUDIENCES", "gpuq")
    monkeypatch.setenv("GPUQ_API_ADMIN_GROUPS", "platform-admins")
    queues = QUEUES.model_copy(update={"namespaces": NAMESPACES})
    for ns in ("ml-team-a", "ml-team-b", "ml-other"):
        await kube_api.create_namespace(ns)
        await kube_api.create_service_account(ns, "pipeline")
    async with api_platform(auth_server, await make_database("tokenreview"), queues, CLUSTER,
                            ("admission", "scheduler", "executor", "audit", "api"),
                            kubeconfig=kube_api.kubeconfig) as running:
        yield running


async def test_service_account_tokens_act_for_their_namespaces_team(platform: ApiPlatform,
                                                                     kube_api: KubeCluster) -> None:
    a = await kube_api.service_account_token("ml-team-a", "pipeline", audiences=("gpuq",))
    b = await kube_api.service_account_token("ml-team-b", "pipeline", audiences=("gpuq",))
    async with httpx.AsyncClient(base_url=platform.base, timeout=30) as c:
        r = await c.post("/v1/jobs", json=job("k8s-a", duration_s=36_000).model_dump(mode="json"), headers=bearer(a))
        assert r.status_code == 202 and r.json()[0]["verdict"] == "queued", r.text
        # Not as another team, and another team's job is not found.
        r = await c.post("/v1/jobs", json=job("k8s-posing", team="team-b").model_dump(mode="json"), headers=bearer(a))
        assert r.status_code == 403 and "team 'team-a' only" in r.json()["detail"]
        assert [j["job_id"] for j in (await c.get("/v1/jobs", headers=bearer(a))).json()] == ["k8s-a"]
        assert (await c.get("/v1/jobs/k8s-a", headers=bearer(b))).status_code == 404
        # A cancel of it is accepted as a request, as for an unknown id (the answer tells nothing of the job), and
        # admission refuses it: the job is still waiting below.
        assert (await c.post("/v1/jobs/k8s-a/cancel", headers=bearer(b))).status_code == 202
        # gpuq's own tokens work beside Kubernetes ones.
        own = await c.get("/v1/jobs/k8s-a", headers=bearer(platform.tokens["a"]))
        assert own.status_code == 200 and own.json()["state"] != "cancelled", own.text
    # Audited as the Kubernetes identity the API server vouched for.
    actor = await wait_for(lambda: platform.conn.fetchval(
        "SELECT actor FROM audit.records WHERE action = 'submit_request' AND job_id = 'k8s-a'"), what="the audit")
    assert actor == "kube:system:serviceaccount:ml-team-a:pipeline"


async def test_tokens_gpuq_cannot_place_are_refused(platform: ApiPlatform, kube_api: KubeCluster) -> None:
    async with httpx.AsyncClient(base_url=platform.base, timeout=30) as c:
        # A token for the API server itself (what every pod holds) is not a gpuq credential.
        own = await kube_api.service_account_token("ml-team-a", "pipeline")
        r = await c.get("/v1/jobs", headers=bearer(own))
        assert r.status_code == 401 and "audience gpuq" in r.json()["detail"]
        # Authenticated, but from a namespace no team owns: refused, saying why.
        other = await kube_api.service_account_token("ml-other", "pipeline", audiences=("gpuq",))
        r = await c.get("/v1/jobs", headers=bearer(other))
        assert r.status_code == 403 and "'ml-other' is not mapped to a team" in r.json()["detail"]
        assert (await c.get("/v1/jobs", headers=bearer("not-a-token"))).status_code == 401


async def test_users_act_for_their_team_group_and_admin_groups_see_everything(platform: ApiPlatform,
                                                                               kube_api: KubeCluster) -> None:
    auth = kube_api.fake.http.api.auth
    bob = auth.add_user_token("bob@example.com", ("gpuq:team:team-b",), ("gpuq",))
    ops = auth.add_user_token("ops@example.com", ("platform-admins",), ("gpuq",))
    both = auth.add_user_token("eve@example.com", ("gpuq:team:team-a", "gpuq:team:team-b"), ("gpuq",))
    nobody = auth.add_user_token("carol@example.com", ("developers",), ("gpuq",))
    async with httpx.AsyncClient(base_url=platform.base, timeout=30) as c:
        r = await c.post("/v1/jobs", json=job("bob-1", team="team-b").model_dump(mode="json"), headers=bearer(bob))
        assert r.status_code == 202, r.text
        r = await c.post("/v1/jobs", json=job("ops-a").model_dump(mode="json"), headers=bearer(platform.tokens["a"]))
        assert r.status_code == 202, r.text
        seen = {j["job_id"] for j in (await c.get("/v1/jobs", params={"all": True}, headers=bearer(ops))).json()}
        assert {"bob-1", "ops-a"} <= seen
        assert {j["job_id"] for j in (await c.get("/v1/jobs", params={"all": True}, headers=bearer(bob))).json()} \
            == {"bob-1"}
        r = await c.get("/v1/jobs", headers=bearer(both))
        assert r.status_code == 403 and "several teams (team-a, team-b)" in r.json()["detail"]
        r = await c.get("/v1/jobs", headers=bearer(nobody))
        assert r.status_code == 403 and "in no group gpuq:team:<team>" in r.json()["detail"]
        # Only an admin approves.
        assert (await c.post("/v1/jobs/bob-1/approve", headers=bearer(bob))).status_code == 403
