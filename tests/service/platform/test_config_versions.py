"""One source of configuration (issue 45, item 6), on a running platform: admission, the scheduler, preemption, the
Kubernetes executor (on the fake API server), the API and audit, on real NATS and Postgres.

What was observed: after a `helm upgrade` of quotas and namespace mappings (a new queues.yaml, every pod restarted),
the executor and the scheduler read the new file, admission and preemption kept the copy in their database, `gpuq
queues` showed the old quota, and nothing was logged. Here a change made through each path (the API, `gpuq
apply-queues`, a changed file at restart) is recorded once by admission as a version (number and content hash),
audited, and applied by every service: each reports that version (/readyz's `config`, `gpuq_config_version`) and
acts on it (the new quota admits a waiting job; a newly mapped namespace gets its job created). An old file at a
restart (an old pod's ConfigMap in a rolling upgrade) rolls nothing back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
import yaml
from click.testing import Result
from typer.testing import CliRunner

from cli.main import app
from services.api import tokens
from services.stack import Stack, StackSettings
from shared.config import parse_queues, queues_hash
from shared.events import QueueConfigChanged, make_event
from shared.health import exposition
from shared.servers import free_port
from shared.service import publish_event
from tests.kube_support import H100, bus_events, eventually, kube_cluster

NS_A, NS_A2 = "ml-team-a", "ml-team-a2"
FOLLOWING = ("admission", "executor", "preemption", "scheduler")  # the services that run on the configuration


def queues_doc(nominal: int, *namespaces: str) -> dict[str, Any]:
    return {"priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
            "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": nominal}}}],
            "namespaces": [{"name": ns, "team": "team-a", "queues": ["team-a"]} for ns in namespaces]}


V1 = queues_doc(8, NS_A)  # the install
V2 = queues_doc(24, NS_A, NS_A2)  # more quota, and a second namespace for team-a
V3 = queues_doc(32, NS_A, NS_A2)


@contextlib.asynccontextmanager
async def platform(fresh: tuple[str, str], kube_api: Any, doc: dict[str, Any]
                   ) -> AsyncIterator[tuple[Stack, httpx.AsyncClient, dict[str, str]]]:
    """Every service that runs on the configuration, started with `doc` as their queues.yaml (as the chart mounts
    one ConfigMap into every pod), with API tokens of team-a and an admin."""
    nats_url, database_url = fresh
    port = free_port()
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=parse_queues(doc),
                             cluster=kube_cluster(), executor="kube", kubeconfig=kube_api.kubeconfig, api_port=port,
                             services=("admission", "scheduler", "preemption", "executor", "api", "audit"))
    async with kube_api.autopilot(), Stack(settings) as stack:
        conn = await asyncpg.connect(database_url)
        try:
            issued = {"a": (await tokens.issue(conn, "alice", team="team-a")).token,
                      "admin": (await tokens.issue(conn, "root", team=None, admin=True)).token}
        finally:
            await conn.close()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            yield stack, http, issued


async def setup_cluster(kube_api: Any) -> None:
    from tests.kube.kubefake.resources import NAMESPACES

    for name in ("n1", "n2", "n3", "n4"):
        kube_api.fake.add_node(name, gpus=8, gpu_product=H100)
    for ns in (NS_A, NS_A2):
        if await kube_api.read(NAMESPACES, ns) is None:
            await kube_api.create_namespace(ns)


async def submit(http: httpx.AsyncClient, token: str, name: str, namespace: str = NS_A) -> str:
    job_id = f"team-a::{name}"
    body = {"job_id": job_id, "team": "team-a", "queue": "team-a", "namespace": namespace,
            "pod_sets": [{"count": 1, "gpus_per_pod": 8, "cpu_milli": 100, "memory_mib": 64,
                          "template": {"image": "busybox:1.36", "command": ["sleep", "3600"]}}]}
    r = await http.post("/v1/jobs", json=body, headers=bearer(token), params={"wait": 0})
    assert r.status_code == 202, r.text
    return job_id


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def statuses(database_url: str) -> dict[str, str]:
    conn = await asyncpg.connect(database_url)
    try:
        return {r["job_id"].split("::")[-1]: r["status"] for r in await conn.fetch(
            "SELECT job_id, status FROM admission.jobs")}
    finally:
        await conn.close()


async def statuses_are(database_url: str, wanted: dict[str, str]) -> bool:
    now = await statuses(database_url)
    return all(now.get(job) == status for job, status in wanted.items())


async def versions(stack: Stack) -> dict[str, int | None]:
    """The configuration version each service reports it runs on (its /readyz report)."""
    report = await stack.health(connections=False)
    return {name: s.config.version if s.config is not None else None
            for name, s in report.services.items() if name in FOLLOWING}


async def all_on(stack: Stack, version: int) -> bool:
    return await versions(stack) == dict.fromkeys(FOLLOWING, version)


async def recorded(database_url: str) -> list[tuple[int, str, str]]:
    """(version, hash, source) of every version admission recorded."""
    conn = await asyncpg.connect(database_url)
    try:
        return [tuple(r) for r in await conn.fetch(
            "SELECT version, hash, source FROM admission.v1_config ORDER BY version")]
    finally:
        await conn.close()


async def audited(database_url: str, action: str) -> list[dict[str, Any]]:
    """The audit service's records of `action` (as recorded by admission: the recorder is the subject's)."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT recorder, actor, detail FROM audit.records WHERE action = $1 ORDER BY id",
                                action)
    except asyncpg.UndefinedTableError:
        return []
    finally:
        await conn.close()
    return [{"recorder": r["recorder"], "actor": r["actor"], **json.loads(r["detail"])} for r in rows]


async def gpuq(env: dict[str, str], *args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, app, list(args), env={"COLUMNS": "200", **env})


async def started(nats_url: str, job_id: str) -> bool:
    return any(e["job_id"] == job_id for e in await bus_events(nats_url, "job.started"))


async def test_a_change_through_the_api_and_through_gpuq_apply_queues_reaches_every_service(
        fresh: tuple[str, str], kube_api: Any, tmp_path: Path) -> None:
    nats_url, database_url = fresh
    direct = {"DATABASE_URL": database_url, "NATS_URL": nats_url, "GPUQ_API_URL": ""}
    await setup_cluster(kube_api)
    async with platform(fresh, kube_api, V1) as (stack, http, issued):
        await eventually("every service on version 1", lambda: all_on(stack, 1))
        await submit(http, issued["a"], "a1")
        await submit(http, issued["a"], "a2")
        await eventually("a1 admitted, a2 waiting for quota",
                         lambda: statuses_are(database_url, {"a1": "admitted", "a2": "pending"}))

        # The API: an admin's change. The quota admits a2; the new namespace is team-a's for the API, admission
        # and the executor, which creates a3's Job there.
        r = await http.put("/v1/queues/config", json={"config": V2}, headers=bearer(issued["admin"]))
        assert r.status_code == 202, r.text
        assert r.json()["hash"] == queues_hash(parse_queues(V2))
        await eventually("a2 admitted under version 2", lambda: statuses_are(database_url, {"a2": "admitted"}))
        await eventually("every service on version 2", lambda: all_on(stack, 2))
        a3 = await submit(http, issued["a"], "a3", namespace=NS_A2)
        await eventually("a3 started in the newly mapped namespace", lambda: started(nats_url, a3))
        assert [(v, s) for v, _, s in await recorded(database_url)] == [(1, "file"), (2, "change")]
        shown = await http.get("/v1/queues/config", headers=bearer(issued["a"]))
        assert shown.status_code == 200 and shown.json()["version"] == 2, shown.text
        assert shown.json()["hash"] == queues_hash(parse_queues(V2)) and "config" not in shown.json()
        metrics = exposition(await stack.health())
        for service in FOLLOWING:
            assert f'gpuq_config_version{{service="{service}"}} 2' in metrics, metrics
            assert f'gpuq_config_file_differs{{service="{service}"}} 1' in metrics  # their file is version 1

        # gpuq apply-queues (an admin's bus credential): it waits until the version is in force and says which.
        await submit(http, issued["a"], "a4")
        await eventually("a4 waiting for quota", lambda: statuses_are(database_url, {"a4": "pending"}))
        (tmp_path / "queues.yaml").write_text(yaml.safe_dump(V3))
        applied = await gpuq(direct, "apply-queues", str(tmp_path / "queues.yaml"), "--by", "alice", "--wait", "60")
        assert applied.exit_code == 0, applied.output
        assert "configuration: version 3" in applied.stdout and "by alice" in applied.stdout, applied.stdout
        await eventually("a4 admitted under version 3", lambda: statuses_are(database_url, {"a4": "admitted"}))
        await eventually("every service on version 3", lambda: all_on(stack, 3))
        shown_queues = await gpuq(direct, "queues")
        assert shown_queues.exit_code == 0, shown_queues.output
        assert "H100-80GB:32" in shown_queues.stdout and "configuration: version 3" in shown_queues.stdout
        through_api = await gpuq({"GPUQ_API_URL": str(http.base_url).rstrip("/"), "GPUQ_TOKEN": issued["a"],
                                  "DATABASE_URL": ""}, "queues")
        assert through_api.exit_code == 0, through_api.output
        assert "configuration: version 3" in through_api.stdout and "by alice" in through_api.stdout

        # The same content again is no new version, and says so in the audit trail.
        again = await gpuq(direct, "apply-queues", str(tmp_path / "queues.yaml"), "--wait", "60")
        assert again.exit_code == 0 and "configuration: version 3" in again.stdout, again.output
        await eventually("the repeat audited", lambda: audited(database_url, "config_unchanged"))
        assert [v for v, _, _ in await recorded(database_url)] == [1, 2, 3]

        # A forged publication (a version admission never recorded, a wider document) moves nobody: every service
        # handles it (its inbox row) and still runs on version 3, which it reads from admission's table.
        forged = make_event(QueueConfigChanged(config=queues_doc(800, NS_A, NS_A2, "kube-system"), changed_by="eve",
                                               config_version=99, config_hash="0" * 64), source="eve",
                            time=datetime.now(UTC))
        nc = await nats.connect(nats_url)
        try:
            await publish_event(nc.jetstream(), forged, QueueConfigChanged.subject())
        finally:
            await nc.close()
        await eventually("every service handled the forged publication", lambda: _handled(database_url, forged.id))
        assert await all_on(stack, 3) and [v for v, _, _ in await recorded(database_url)] == [1, 2, 3]
        await submit(http, issued["a"], "a5")
        await eventually("a5 waiting: version 3's 32 GPUs are held", lambda: statuses_are(database_url,
                                                                                        {"a5": "pending"}))

        # Each change audited once, by admission, with its version and hash and who proposed it.
        applied_records = await eventually("three versions audited",
                                           lambda: _at_least(audited(database_url, "config_applied"), 3))
        assert [(r["recorder"], r["version"], r["source"]) for r in applied_records] == [
            ("admission", 1, "file"), ("admission", 2, "change"), ("admission", 3, "change")]
        assert [r["hash"] for r in applied_records] == [h for _, h, _ in await recorded(database_url)]
        assert applied_records[1]["actor"] == "admin:root" and applied_records[2]["actor"] == "alice"


async def test_a_changed_file_at_restart_is_applied_everywhere_and_an_old_one_rolls_nothing_back(
        fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    direct = {"DATABASE_URL": database_url, "NATS_URL": nats_url, "GPUQ_API_URL": ""}
    await setup_cluster(kube_api)
    async with platform(fresh, kube_api, V1) as (stack, http, issued):
        await eventually("every service on version 1", lambda: all_on(stack, 1))
        await submit(http, issued["a"], "a1")
        await submit(http, issued["a"], "a2")
        await eventually("a1 admitted, a2 waiting for quota",
                         lambda: statuses_are(database_url, {"a1": "admitted", "a2": "pending"}))

    # helm upgrade: a new ConfigMap, every pod restarted with it.
    async with platform(fresh, kube_api, V2) as (stack, http, issued):
        await eventually("a2 admitted under the new file's quota", lambda: statuses_are(database_url,
                                                                                      {"a2": "admitted"}))
        shown = await gpuq(direct, "queues")
        assert shown.exit_code == 0, shown.output
        assert "H100-80GB:24" in shown.stdout and "configuration: version 2" in shown.stdout, shown.stdout
        await eventually("every service on version 2", lambda: all_on(stack, 2))
        # Six services started with the file: one version, recorded by admission.
        assert [(v, s) for v, _, s in await recorded(database_url)] == [(1, "file"), (2, "file")]
        a3 = await submit(http, issued["a"], "a3", namespace=NS_A2)
        await eventually("a3 started in the namespace the new file maps", lambda: started(nats_url, a3))
        report = await stack.health(connections=False)
        assert not any(report.services[s].config.file_differs for s in FOLLOWING)  # type: ignore[union-attr]

    # An old pod's file (a rolling upgrade, a restarted old replica): version 2 stays in force everywhere.
    async with platform(fresh, kube_api, V1) as (stack, http, issued):
        await eventually("every service on version 2", lambda: all_on(stack, 2))
        report = await stack.health(connections=False)
        for service in FOLLOWING:
            config = report.services[service].config
            assert config is not None and config.file_differs, (service, config)
        assert "older version" in report.services["scheduler"].config.detail  # type: ignore[union-attr]
        # The namespace version 2 maps stays team-a's (the API and admission judge with the version in force).
        await submit(http, issued["a"], "a4", namespace=NS_A2)
        await eventually("a4 waiting: a1-a3 hold version 2's 24 GPUs",
                         lambda: statuses_are(database_url, {"a4": "pending"}))
        assert [v for v, _, _ in await recorded(database_url)] == [1, 2]
        stale = await eventually("the old file audited", lambda: audited(database_url, "config_file_stale"))
        assert stale[0]["version"] == 2 and stale[0]["file_version"] == 1, stale
        shown = await gpuq(direct, "queues")
        assert "H100-80GB:24" in shown.stdout and "configuration: version 2" in shown.stdout, shown.stdout
    assert [(r["version"], r["source"]) for r in await audited(database_url, "config_applied")] == [
        (1, "file"), (2, "file")]


async def _handled(database_url: str, event_id: str) -> bool:
    conn = await asyncpg.connect(database_url)
    try:
        return all([await conn.fetchval(f"SELECT EXISTS (SELECT 1 FROM {schema}.inbox WHERE event_id LIKE $1)",
                                        event_id + "%") for schema in FOLLOWING])
    finally:
        await conn.close()


async def _at_least(rows: Any, n: int) -> list[dict[str, Any]] | None:
    found = await rows
    return found if len(found) >= n else None
