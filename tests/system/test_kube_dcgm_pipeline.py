"""Real GPU utilisation and health on Kubernetes: the DCGM source in the Kubernetes executor, end to end.

A PyTorchJob (2 workers × 8 GPUs) runs on fake GPU nodes (the fake API server, its controllers and kubelet). A
fixture dcgm-exporter, scraped by a real Prometheus that relabels its pod labels to `exported_*`, serves series
labelled with the pod names the fake PyTorchJob controller gave the workers. The test asserts that:
- the samples reach the metering ledger with the fixture's values: exactly by pod labels on one worker's node (which
  reports a ninth GPU the device plugin hides, so nothing but the labels could say which GPUs are the pod's), and
  exactly on the other worker's node, which has no pod labels but whose every GPU the job holds;
- an XID degrades the spare node (NodeChanged), and the scheduler does not place a waiting Job there;
- the Node updates the informer sees meanwhile (a label change, a cordon and uncordon, a relist after the watch
  history is compacted) do not announce it ready again;
- clean polls bring it back, and the waiting Job is placed on it.
Real NATS, real Postgres, a real Prometheus, the fake API server through the executor's real client.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import asyncpg
import pytest
from lightkube.generic_resource import create_namespaced_resource

from services.api.readmodel import fetch_status
from shared.config import DcgmSettings, parse_queues
from shared.events import UtilizationSourceChecked
from tests.kube_support import H100, bus_events, eventually, fetchval, kube_cluster, kube_stack, set_node
from tests.support.dcgm_fixture import FixtureExporter, FixtureGpu
from tests.support.prometheus_process import running_prometheus

NS = "ml-team-a"
INTERVAL_S = 2.0
LOOKBACK_S = 2 * INTERVAL_S
POOL = "gpuq.io/pool"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 24}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})
PYTORCHJOB = create_namespaced_resource("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs")
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")
NODES = ("n1", "n2", "n3")
# The labelled worker's GPUs, the unlabelled worker's, and idle GPUs (the spare node, the hidden GPU).
LABELLED_UTIL, UNLABELLED_UTIL = 0.75, 0.5
PRODUCT = "NVIDIA H100 80GB HBM3"


def values(util: float, fb: float, tensor: float = 0.0) -> dict[str, float]:
    return {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": util, "DCGM_FI_DEV_GPU_UTIL": round(util * 100),
            "DCGM_FI_DEV_FB_USED": fb, "DCGM_FI_DEV_FB_FREE": 81_000 - fb, "DCGM_FI_DEV_POWER_USAGE": 90 + 500 * util,
            "DCGM_FI_DEV_GPU_TEMP": 45 + 30 * util, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": tensor,
            "DCGM_FI_DEV_XID_ERRORS": 0}


def container(gpus: int) -> dict[str, Any]:
    return {"name": "pytorch", "image": "ghcr.io/example/bert:2.0", "command": ["torchrun", "train.py"],
            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"cpu": "16", "memory": "64Gi"}}}


def pytorchjob() -> Any:
    return PYTORCHJOB({
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": "bert", "namespace": NS, "labels": {"gpuq.io/queue": "team-a"}},
        "spec": {"runPolicy": {"suspend": True}, "pytorchReplicaSpecs": {"Worker": {
            "replicas": 2, "restartPolicy": "Never", "template": {"spec": {"containers": [container(8)]}}}}}})


def batch_job(name: str) -> Any:
    return JOB({"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": name, "namespace": NS, "labels": {"gpuq.io/queue": "team-a"}},
                "spec": {"suspend": True, "completionMode": "Indexed", "completions": 1, "parallelism": 1,
                         "template": {"spec": {"restartPolicy": "Never", "containers": [container(8)]}}}})


async def scheduler_node(database_url: str, name: str) -> dict[str, Any]:
    raw = await fetchval(database_url, "SELECT spec FROM scheduler.nodes WHERE name = $1", name)
    spec: dict[str, Any] = json.loads(raw) if raw else {}
    return spec


async def status_of(database_url: str, name: str) -> dict[str, Any] | None:
    rows = [r for r in await fetch_status(database_url, None) if r["job_id"].startswith(f"{NS}.{name}.")]
    return rows[0] if rows else None


async def test_dcgm_source_in_the_kubernetes_executor(fresh: tuple[str, str], kube_api: Any,
                                                      tmp_path: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    for name in NODES:
        fake.add_node(name, gpus=8, gpu_product=H100, gpu_memory_mib=81559, labels={POOL: "train"},
                      unschedulable=name == "n3")  # n3 is the spare: the PyTorchJob lands on n1 and n2
    fake.kubelet.start_pods = False  # the workers start when the test says (after the fixture knows them)
    await kube_api.create_namespace(NS)
    exporter = FixtureExporter([FixtureGpu(node, g, PRODUCT, values(0.0, 0)) for node in NODES for g in range(8)])
    exporter_port = exporter.start()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        # The exporter runs as a pod itself: its target labels pod/namespace clash with the series' own, which
        # Prometheus therefore renames exported_pod/exported_namespace (honor_labels: false, the default).
        "scrape_configs": [{"job_name": "dcgm-exporter", "static_configs": [{
            "targets": [f"127.0.0.1:{exporter_port}"],
            "labels": {"namespace": "gpu-operator", "pod": "nvidia-dcgm-exporter-5kq2w"}}]}],
    }
    try:
        with running_prometheus(tmp_path, config) as prom_url:
            dcgm = DcgmSettings(prometheus_url=prom_url, interval_s=INTERVAL_S, lookback_s=LOOKBACK_S,
                                timeout_s=INTERVAL_S, selector='job="dcgm-exporter"', missing_gpu_polls=2,
                                recovery_polls=2)
            cluster = kube_cluster(pool_label=POOL)
            async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, cluster, kube_api.kubeconfig,
                                                        ("admission", "scheduler", "executor", "metering"), dcgm):
                await scenario(nats_url, database_url, kube_api, exporter)
    finally:
        exporter.stop()


async def scenario(nats_url: str, database_url: str, kube_api: Any, exporter: FixtureExporter) -> None:
    client = kube_api.client()
    await client.create(pytorchjob())

    async def bound() -> dict[str, str] | None:
        pods = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in await kube_api.pods(NS, "gpuq.io/job")}
        return pods if len(pods) == 2 and all(pods.values()) else None

    # ---- 1. dcgm-exporter learns which pod holds which GPU; the workers then run
    workers = await eventually("both workers bound to nodes", bound)
    assert sorted(workers) == ["bert-worker-0", "bert-worker-1"]  # as the PyTorchJob controller names them
    labelled, unlabelled = workers["bert-worker-0"], workers["bert-worker-1"]
    assert {labelled, unlabelled} == {"n1", "n2"}
    for g in range(8):
        exporter.set_pod(labelled, g, (NS, "bert-worker-0", "pytorch"))
        for metric, value in values(LABELLED_UTIL, 60_000, tensor=0.45).items():
            exporter.set(labelled, g, metric, value)
        for metric, value in values(UNLABELLED_UTIL, 50_000, tensor=0.3).items():
            exporter.set(unlabelled, g, metric, value)
    # A ninth GPU the device plugin does not offer (allocatable is 8): without pod labels, which 8 GPUs of that
    # node are the worker's would be unknown.
    exporter.add(FixtureGpu(labelled, 8, PRODUCT, values(0.0, 0)))
    # The first samples of the running job average a window that holds only the new values.
    await asyncio.sleep(LOOKBACK_S + 2.0)
    await kube_api.run_pods_to_ready(NS, "gpuq.io/job", count=2)
    started = await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))
    job_id = started[0]["job_id"]

    # ---- 2. the ledger: every sample of the job carries its GPU's fixture values
    async def enough_samples() -> bool:
        n = await fetchval(database_url, "SELECT count(*) FROM metering.gpu_samples WHERE job_id = $1", job_id)
        return bool(n and n >= 16 * 3)

    await eventually("three polls of the job's 16 GPUs in the ledger", enough_samples, timeout_s=90)
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT * FROM metering.gpu_samples WHERE job_id = $1 ORDER BY sampled_at", job_id)
        for node, util in ((labelled, LABELLED_UTIL), (unlabelled, UNLABELLED_UTIL)):
            mine = [r for r in rows if r["node"] == node]
            assert {r["gpu_index"] for r in mine} == set(range(8)), node
            assert {r["interval_ms"] for r in mine} == {2000}
            assert all(r["utilization_pct"] == pytest.approx(util * 100, abs=1e-4) for r in mine), node
            per_sample = round(util * 100 * 2000 * 1000 / 100_000)
            assert {r["used_gpu_ms"] for r in mine} == {per_sample}, node
            used, n = await conn.fetchrow("SELECT sum(used_gpu_ms), sum(samples) FROM metering.usage_hourly "
                                          "WHERE job_id = $1 AND node = $2", job_id, node)
            assert n >= len(mine) and used == n * per_sample, node
        # The hidden GPU and the spare node's GPUs are sampled with no job.
        free = await conn.fetch("SELECT DISTINCT node, gpu_index FROM metering.gpu_samples WHERE job_id IS NULL "
                                "AND sampled_at > (SELECT min(sampled_at) FROM metering.gpu_samples WHERE job_id = $1)",
                                job_id)
        assert {(r["node"], r["gpu_index"]) for r in free} == {(labelled, 8), *(("n3", g) for g in range(8))}
        # Both workers' GPUs were attributed exactly (by pod labels, and as the holder of every GPU of its node).
        checked = await conn.fetchval(  # the latest poll that reached Prometheus (a loaded machine may time out)
            "SELECT body FROM executor.outbox WHERE subject = $1 AND convert_from(body, 'UTF8')::jsonb #>> "
            "'{data,ok}' = 'true' ORDER BY seq DESC LIMIT 1", UtilizationSourceChecked.subject())
        data = json.loads(checked)["data"]
        assert (data["gpus_exact"], data["gpus_approximate"], data["gpus_unattributed"]) == (16, 0, 9)
    finally:
        await conn.close()

    # ---- 3. an XID degrades the spare node; a waiting Job is not placed there
    await set_node(client, "n3", {"spec": {"unschedulable": None}})
    exporter.set("n3", 1, "DCGM_FI_DEV_XID_ERRORS", 79)

    async def degraded() -> bool:
        return (await scheduler_node(database_url, "n3")).get("health") == "degraded"

    await eventually("n3 degraded in the scheduler", degraded, timeout_s=60)
    changes = [e for e in await bus_events(nats_url, "node.changed") if e["node"]["name"] == "n3"]
    assert changes[-1]["reason"] == "Xid79" and changes[-1]["node"]["health"] == "degraded"
    await client.create(batch_job("late"))

    async def late_waits() -> dict[str, Any] | None:
        row = await status_of(database_url, "late")
        return row if row is not None and row["state"] == "admitted" and row["sched_reason"] else None

    assert (await eventually("the late Job to wait for GPUs", late_waits))["sched_reason"] == "InsufficientGpus"

    # ---- 4. Node updates meanwhile do not announce n3 ready again
    # GPU Feature Discovery's timestamp changes at every pass and selects nothing (`kubernetes.ignored_labels`)
    await set_node(client, "n3", {"metadata": {"labels": {"nvidia.com/gfd.timestamp": "1796428800"}}})
    await set_node(client, "n3", {"metadata": {"labels": {POOL: "spare"}}})

    async def relabelled() -> bool:
        return (await scheduler_node(database_url, "n3")).get("labels", {}).get("pool") == "spare"

    await eventually("the label change announced", relabelled)
    assert (await scheduler_node(database_url, "n3"))["health"] == "degraded"
    # One NodeChanged for the two updates: the executor knew it had announced n3 degraded (the label it ignores
    # changed nothing; every other label is announced, since a workload may select on it), and the pool change is
    # announced with the degradation.
    since = [e for e in await bus_events(nats_url, "node.changed") if e["node"]["name"] == "n3"][len(changes):]
    assert [(e["node"]["labels"].get("pool"), e["node"]["health"]) for e in since] == [("spare", "degraded")]
    await set_node(client, "n3", {"spec": {"unschedulable": True}})
    await eventually("n3 cordoned", lambda: _health_is(database_url, "cordoned"))
    await set_node(client, "n3", {"spec": {"unschedulable": None}})
    await eventually("n3 uncordoned, still degraded", lambda: _health_is(database_url, "degraded"))
    kube_api.fake.store.compact()  # the informers' watches end with 410 Gone: they relist every node and pod
    deadline = time.monotonic() + 3 * INTERVAL_S
    while time.monotonic() < deadline:
        assert (await scheduler_node(database_url, "n3"))["health"] == "degraded"
        assert (await status_of(database_url, "late") or {}).get("state") == "admitted"  # still not placed
        await asyncio.sleep(0.5)
    # No NodeChanged announced n3 ready after the degradation (`changes`: n3's events up to it).
    assert not [e for e in await bus_events(nats_url, "node.changed")
                if e["node"]["name"] == "n3" and e["node"]["health"] == "ready" and e not in changes]

    # ---- 5. the GPU is reset: clean polls bring n3 back, and the Job runs there
    exporter.set("n3", 1, "DCGM_FI_DEV_XID_ERRORS", 0)

    async def late_on_n3() -> list[dict[str, Any]] | None:
        pods = [p for p in await kube_api.pods(NS, "batch.kubernetes.io/job-name=late")
                if not p["spec"].get("schedulingGates")]
        return pods or None

    pods = await eventually("the late Job's pod ungated after recovery", late_on_n3, timeout_s=60)
    assert pods[0]["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "n3"
    recovered = [e for e in await bus_events(nats_url, "node.changed") if e["node"]["name"] == "n3"][-1]
    assert recovered["node"]["health"] == "ready" and "ready again" in recovered["message"]


async def _health_is(database_url: str, health: str) -> bool:
    return (await scheduler_node(database_url, "n3")).get("health") == health
