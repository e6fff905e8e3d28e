"""Issue 44, items 3 and 4, replayed against an API server (the fake) with real NATS and Postgres, as a hostile team
would: a team's jobs stay in the team's namespaces, run as the service accounts and with the Secrets its policy
lists and under the Pod Security `restricted` profile; and a workload is the job gpuq bound to its uid, whatever
its annotations claim.

- The namespace escape: team-a's API token sent a job into `gpuq-system` running as `gpuq-executor` with the
  `gpuq-database` Secret mounted and the node's `/` (admission accepted it, the executor created it).
- The cross-team annotation: team-b, in its own namespace, annotated a workload with team-a's job id; when that
  workload finished, team-a's job was reported completed (its pods running on), and deleting it cancelled the job.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import nats
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Secret

from services.api import tokens
from services.stack import Stack, StackSettings
from shared.config import QueuesConfig, parse_queues
from shared.domain import JobSpec
from shared.events import JobSubmitted, make_event
from shared.servers import free_port
from shared.service import publish_event
from tests.kube_support import H100, bus_events, eventually, fetchval, kube_cluster, workload_events

NS_A, NS_B, SYSTEM = "ml-team-a", "ml-team-b", "gpuq-system"
QUEUES_DOC: dict[str, Any] = {
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 16}}},
               {"name": "team-b", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 16}}}],
    "namespaces": [{"name": NS_A, "team": "team-a", "queues": ["team-a"]},
                   {"name": NS_B, "team": "team-b", "queues": ["team-b"]}],
}
QUEUES = parse_queues(QUEUES_DOC)
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")
# What the escape asked for, one piece at a time (each alone is refused) and all together.
ESCAPE_PARTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "namespace": ({"namespace": SYSTEM}, {}),
    "service account": ({}, {"service_account_name": "gpuq-executor"}),
    "secret": ({}, {"volumes": [{"name": "db", "secret": {"secretName": "gpuq-database"}}],
                    "volume_mounts": [{"name": "db", "mountPath": "/db"}]}),
    "secret env": ({}, {"env": [{"name": "DATABASE_URL", "value_from": {
        "secretKeyRef": {"name": "gpuq-database", "key": "uri"}}}]}),
    "host path": ({}, {"volumes": [{"name": "root", "hostPath": {"path": "/"}}],
                       "volume_mounts": [{"name": "root", "mountPath": "/host"}]}),
}
REFUSED_BECAUSE = {
    "namespace": "namespace 'gpuq-system' is not one of team team-a's",
    "service account": "ServiceAccount 'gpuq-executor'",
    "secret": "Secret 'gpuq-database'",
    "secret env": "Secret 'gpuq-database'",
    "host path": "hostPath",
}


def job_body(job_id: str, *, spec: dict[str, Any] | None = None, template: dict[str, Any] | None = None,
             command: tuple[str, ...] = ("sleep", "3600")) -> dict[str, Any]:
    return {"job_id": job_id, "team": "team-a", "queue": "team-a", **(spec or {}),
            "pod_sets": [{"count": 1, "gpus_per_pod": 1, "cpu_milli": 100, "memory_mib": 64,
                          "template": {"image": "busybox:1.36", "command": list(command), **(template or {})}}]}


def escape(*parts: str) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    template: dict[str, Any] = {}
    for part in parts:
        extra_spec, extra_template = ESCAPE_PARTS[part]
        spec.update(extra_spec)
        for key, value in extra_template.items():
            template[key] = [*template.get(key, []), *value] if isinstance(value, list) else value
    return job_body("team-a::escape-" + "-".join(p.replace(" ", "") for p in parts), spec=spec, template=template)


async def ensure_namespace(kube_api: Any, name: str) -> None:
    from tests.kube.kubefake.resources import NAMESPACES

    if await kube_api.read(NAMESPACES, name) is None:
        await kube_api.create_namespace(name)


async def the_platforms_secrets(kube_api: Any) -> None:
    """What the escape went for: the release namespace, the executor's ServiceAccount and the database Secret."""
    await ensure_namespace(kube_api, SYSTEM)
    client = kube_api.client()
    with contextlib.suppress(Exception):
        await kube_api.create_service_account(SYSTEM, "gpuq-executor")
    with contextlib.suppress(Exception):
        await client.create(Secret.from_dict({"metadata": {"name": "gpuq-database", "namespace": SYSTEM},
                                              "stringData": {"uri": "postgresql://gpuq:secret@db/gpuq"}}))


@contextlib.asynccontextmanager
async def platform(fresh: tuple[str, str], kube_api: Any, queues: QueuesConfig = QUEUES
                   ) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str]]]:
    """Admission, scheduler, the Kubernetes executor and the API, with API tokens of team-a, team-b and an admin."""
    async with platform_and_stack(fresh, kube_api, queues) as (_, http, issued):
        yield http, issued


@contextlib.asynccontextmanager
async def platform_and_stack(fresh: tuple[str, str], kube_api: Any, queues: QueuesConfig = QUEUES
                             ) -> AsyncIterator[tuple[Stack, httpx.AsyncClient, dict[str, str]]]:
    nats_url, database_url = fresh
    port = free_port()
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=queues, cluster=kube_cluster(),
                             services=("admission", "scheduler", "executor", "api", "audit"), executor="kube",
                             kubeconfig=kube_api.kubeconfig, api_port=port)
    async with kube_api.autopilot(), Stack(settings) as stack:
        conn = await asyncpg.connect(database_url)
        try:
            issued = {"a": (await tokens.issue(conn, "alice", team="team-a")).token,
                      "b": (await tokens.issue(conn, "mallory", team="team-b")).token,
                      "admin": (await tokens.issue(conn, "root", team=None, admin=True)).token}
        finally:
            await conn.close()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            await eventually("the API answering", lambda: _answers(http, issued["a"]))
            yield stack, http, issued


async def _answers(http: httpx.AsyncClient, token: str) -> bool:
    try:
        r = await http.get("/v1/jobs", headers=bearer(token))
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def submitted(http: httpx.AsyncClient, token: str, body: dict[str, Any]) -> httpx.Response:
    return await http.post("/v1/jobs", json=body, headers=bearer(token), params={"wait": 0})


async def jobs_in(kube_api: Any, namespace: str) -> list[dict[str, Any]]:
    return [j.to_dict() async for j in kube_api.client().list(JOB, namespace=namespace)]


async def events_of(nats_url: str, fact: str, job_id: str) -> list[dict[str, Any]]:
    return [e for e in await bus_events(nats_url, f"job.{fact}") if e["job_id"] == job_id]


def add_gpu_nodes(kube_api: Any) -> None:
    for name in ("n1", "n2"):
        kube_api.fake.add_node(name, gpus=8, gpu_product=H100)


async def test_a_team_token_cannot_send_a_job_out_of_its_namespaces_or_past_its_policy(
        fresh: tuple[str, str], kube_api: Any) -> None:
    """Refused at the API (admission judges the same way): nothing is published, so nothing can be created. Needs no
    GPU node, so it runs on a real cluster too."""
    for ns in (NS_A, NS_B):
        await ensure_namespace(kube_api, ns)
    await the_platforms_secrets(kube_api)
    async with platform(fresh, kube_api) as (http, issued):
        answers = {}
        for part in ESCAPE_PARTS:
            answers[part] = await submitted(http, issued["a"], escape(part))
        whole = await submitted(http, issued["a"], escape(*ESCAPE_PARTS))
        # Another team's namespace is no better than the platform's.
        neighbour = await submitted(http, issued["a"], job_body("team-a::next-door", spec={"namespace": NS_B}))
        # A job that stays home is taken.
        home = await submitted(http, issued["a"], job_body("team-a::home", spec={"namespace": NS_A}))
    assert {part: r.status_code for part, r in answers.items()} == dict.fromkeys(ESCAPE_PARTS, 422)
    for part, r in answers.items():
        assert "PolicyViolation" in r.text and REFUSED_BECAUSE[part] in r.text, (part, r.text)
    assert whole.status_code == 422 and neighbour.status_code == 422
    assert "namespace 'ml-team-b' is not one of team team-a's" in neighbour.text
    assert home.status_code == 202, home.text
    assert await jobs_in(kube_api, SYSTEM) == [] and await jobs_in(kube_api, NS_B) == []


async def test_a_job_that_stays_home_runs_under_the_restricted_profile(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, _ = fresh
    add_gpu_nodes(kube_api)
    await ensure_namespace(kube_api, NS_A)
    async with platform(fresh, kube_api) as (http, issued):
        home = await submitted(http, issued["a"], job_body("team-a::home", spec={"namespace": NS_A}))
        assert home.status_code == 202, home.text
        await eventually("the home job started", lambda: events_of(nats_url, "started", "team-a::home"))
        created = await job_of(kube_api, NS_A, "team-a::home")
    pod = created["spec"]["template"]["spec"]
    assert pod.get("serviceAccountName", "default") == "default"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


async def test_the_executor_creates_nothing_in_a_namespace_the_version_in_force_does_not_give_the_team(
        fresh: tuple[str, str], kube_api: Any) -> None:
    """Defence in depth: an admin's mistake gave team-a `gpuq-system`, and team-a's job there was admitted (it waits
    for GPUs); the admin then corrected the configuration (a new version). Admission does not judge an admitted job
    again; the executor judges its namespace with the version in force when it is placed, and creates nothing there.
    (The executor runs on admission's version, not on a file of its own: one source of configuration, docs/
    admission.md. A forged configuration event is refused by the bus (tests/service/security/test_attacks.py), and
    the chart's RBAC lets the executor create only in the namespaces mapped at install.)"""
    nats_url, database_url = fresh
    await ensure_namespace(kube_api, NS_A)
    await the_platforms_secrets(kube_api)
    widened = copy.deepcopy(QUEUES_DOC)
    widened["namespaces"].append({"name": SYSTEM, "team": "team-a", "queues": ["team-a"]})
    async with platform_and_stack(fresh, kube_api, parse_queues(widened)) as (stack, http, issued):
        probe = await submitted(http, issued["a"], job_body("team-a::probe", spec={"namespace": SYSTEM}))
        assert probe.status_code == 202, probe.text
        await eventually("the probe admitted", lambda: _admitted(database_url, "team-a::probe"))
        corrected = await http.put("/v1/queues/config", json={"config": QUEUES_DOC},
                                   headers=bearer(issued["admin"]))
        assert corrected.status_code == 202, corrected.text
        await eventually("the executor on the corrected version", lambda: _executor_on(stack, 2))
        add_gpu_nodes(kube_api)
        (ended,) = await eventually("the job failed", lambda: _failed_or_started(nats_url, "team-a::probe"))
    assert ended["fact"] == "failed", ended
    assert "namespace gpuq-system is not mapped to team team-a in the queue configuration in force (version 2" in \
        ended["message"], ended
    assert await jobs_in(kube_api, SYSTEM) == []
    assert await fetchval(database_url, "SELECT count(*) FROM executor.kube_jobs WHERE namespace = $1", SYSTEM) == 0


async def _admitted(database_url: str, job_id: str) -> bool:
    return await fetchval(database_url, "SELECT status FROM admission.jobs WHERE job_id = $1", job_id) == "admitted"


async def _executor_on(stack: Stack, version: int) -> bool:
    config = (await stack.health(connections=False)).services["executor"].config
    return config is not None and config.version == version


async def _failed_or_started(nats_url: str, job_id: str) -> list[dict[str, Any]]:
    return [{**e, "fact": fact} for fact in ("failed", "started") for e in await events_of(nats_url, fact, job_id)]


async def job_of(kube_api: Any, namespace: str, job_id: str) -> dict[str, Any]:
    (found,) = [j for j in await jobs_in(kube_api, namespace)
                if (j["metadata"].get("annotations") or {}).get("gpuq.io/job-id") == job_id]
    return found


async def test_a_workload_claiming_another_teams_job_id_is_refused_and_audited(
        fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    add_gpu_nodes(kube_api)
    for ns in (NS_A, NS_B):
        await ensure_namespace(kube_api, ns)
    client = kube_api.client()
    async with platform(fresh, kube_api) as (http, issued):
        r = await submitted(http, issued["a"], job_body("team-a::victim", spec={"namespace": NS_A}))
        assert r.status_code == 202, r.text
        await eventually("team-a's job started", lambda: events_of(nats_url, "started", "team-a::victim"))
        # team-b, in its own namespace, claims team-a's job: a workload that finishes at once, then is deleted.
        container = {"name": "c", "image": "busybox:1.36", "command": ["true"],
                     "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}
        await client.create(JOB({"metadata": {"name": "claim", "namespace": NS_B,
                                              "labels": {"gpuq.io/queue": "team-b"},
                                              "annotations": {"gpuq.io/job-id": "team-a::victim"}},
                                 "spec": {"suspend": False, "backoffLimit": 0, "template": {"spec": {
                                     "restartPolicy": "Never", "containers": [container]}}}}))

        await eventually("team-b's workload finished", lambda: _finished(kube_api, NS_B, "claim"))
        await client.delete(JOB, "claim", namespace=NS_B)

        async def outcome() -> Any:
            """The refusal and its audit record, or what the claim did to team-a's job."""
            harm = (await events_of(nats_url, "completed", "team-a::victim")
                    + await events_of(nats_url, "cancel_requested", "team-a::victim"))
            refusals = [e for e in await workload_events(client, NS_B, "claim") if e["reason"] == "JobIdClaimed"]
            record = await _audited(database_url)
            return (harm, refusals, record) if harm or (refusals and record) else None

        harm, refusals, record = await eventually("the claim answered", outcome)
        job = (await http.get("/v1/jobs/team-a::victim", headers=bearer(issued["a"]))).json()
        uid = await fetchval(database_url, "SELECT uid FROM executor.kube_jobs WHERE job_id = 'team-a::victim'")
    assert harm == [], harm
    assert "team-a::victim" in refusals[0]["message"] and "gpuq.io/job-id" in refusals[0]["message"]
    assert job["state"] == "running", job
    assert (record["actor"], record["team"], record["job_id"]) == (f"namespace:{NS_B}", "team-b", None)
    assert json.loads(record["detail"])["claimed_job_id"] == "team-a::victim"
    # The binding is the workload gpuq created for the job, in team-a's namespace.
    (own,) = await jobs_in(kube_api, NS_A)
    assert own["metadata"]["uid"] == uid


async def _finished(kube_api: Any, namespace: str, name: str) -> bool:
    obj = (await kube_api.client().get(JOB, name, namespace=namespace)).to_dict()
    return any(c["type"] in ("Complete", "Failed") and c["status"] == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


async def _audited(database_url: str) -> Any:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetchrow("SELECT actor, team, action, job_id, detail FROM audit.records "
                                   "WHERE action = 'workload_refused'")
    finally:
        await conn.close()


async def test_a_refused_resubmission_of_a_running_jobs_id_leaves_the_job_running(
        fresh: tuple[str, str], kube_api: Any) -> None:
    """Admission refuses a later submission of a job's id (the team's own duplicate, or another team trying to take
    it) with a JobRejected under that id. That verdict is about the submission, not the job: the executor must keep
    managing the running workload (before, it marked it rejected and let go of it, pods still running)."""
    nats_url, database_url = fresh
    add_gpu_nodes(kube_api)
    await ensure_namespace(kube_api, NS_A)
    async with platform(fresh, kube_api) as (http, issued):
        r = await submitted(http, issued["a"], job_body("shared-7", spec={"namespace": NS_A}))
        assert r.status_code == 202, r.text
        await eventually("team-a's job started", lambda: events_of(nats_url, "started", "shared-7"))
        # On each team's own submission subject (the API would refuse both itself, before the bus).
        nc = await nats.connect(nats_url)
        try:
            for body in (job_body("shared-7", spec={"namespace": NS_A}),
                         {**job_body("shared-7"), "team": "team-b", "queue": "team-b"}):
                spec = JobSpec.model_validate(body)
                await publish_event(nc.jetstream(), make_event(
                    JobSubmitted(spec=spec, submitted_at=datetime.now(UTC)), source="test", time=datetime.now(UTC)),
                    f"{JobSubmitted.subject()}.{spec.team}")
        finally:
            await nc.close()
        rejected = await eventually("both refusals on the bus", lambda: _both(nats_url))
        assert sorted(e["reason"] for e in rejected) == ["DuplicateJobId", "JobIdUnavailable"], rejected

        async def seen_by_the_executor() -> bool:
            return await fetchval(database_url, "SELECT count(*) FROM executor.inbox WHERE type LIKE '%job.rejected%'"
                                  ) == 2

        await eventually("the executor handled both refusals", seen_by_the_executor)
        state = await fetchval(database_url, "SELECT state FROM executor.kube_jobs WHERE job_id = 'shared-7'")
        job = (await http.get("/v1/jobs/shared-7", headers=bearer(issued["a"]))).json()
    assert state == "running", state
    assert job["state"] == "running", job


async def _both(nats_url: str) -> list[dict[str, Any]] | None:
    found = await events_of(nats_url, "rejected", "shared-7")
    return found if len(found) >= 2 else None
