"""The DCGM source in the Kubernetes executor, against the fake API server (and, for the second test, real NATS and
Postgres): the pods every workload kind's controller creates are found under their own names, and a Prometheus
that cannot be reached is a clear error while jobs keep running; the source's verdicts survive restarts, and
leave with the source."""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml
from lightkube.generic_resource import create_namespaced_resource

from services.core.executor.attribution import attribute
from services.core.executor.dcgm_series import parse_results
from services.core.kube.dcgm_view import RunningJob, placements
from services.core.kube.intake import Refusal, job_spec
from services.core.kube.kinds import kind_of
from services.core.kube.names import JOB_LABEL, job_label
from services.core.kube.placement import placed_templates
from services.executor.dcgm import degraded_nodes
from services.executor.kube import inventory
from services.executor.kube.client import KubeApi, load_config, workload_resource
from shared.config import DcgmLabels, DcgmSettings, load_cluster, load_queues, parse_queues
from shared.domain import GpuBinding, NodeHealth
from shared.events import UtilizationSourceChecked
from shared.service import Tx
from tests.kube.kubefake.resources import NODES
from tests.kube_support import H100, bus_events, eventually, fetchval, kube_cluster, kube_stack
from tests.support.prometheus_process import free_port
from tests.unit.executor.dcgm_builders import busy, gpu, node, results

EXAMPLES = Path(__file__).resolve().parents[3] / "deploy" / "examples"
NS = "ml-team-a"  # the examples' namespace


async def test_the_pods_of_every_workload_kind_are_found_under_their_controllers_names(kube_api: Any) -> None:
    fake = kube_api.fake  # the Job, JobSet, PyTorchJob and RayJob controllers name the pods
    await kube_api.create_namespace(NS)
    queues, cluster = load_queues(EXAMPLES / "queues.yaml"), load_cluster(EXAMPLES / "k8s" / "cluster.yaml")
    api = KubeApi(load_config(kube_api.kubeconfig))
    running: list[RunningJob] = []
    try:
        # Each example is created suspended, then resumed with the templates gpuq writes when it places a job.
        for path in sorted((EXAMPLES / "k8s").glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                kind = kind_of(doc.get("apiVersion", ""), doc.get("kind", ""))
                if kind is None:
                    continue
                res = workload_resource(kind)
                created = await api.create(res, doc, namespace=NS)
                spec = job_spec(kind, created, queues, cluster.kube)
                assert not isinstance(spec, Refusal), f"{path.name}: {spec}"
                bindings = [GpuBinding(pod=f"{ps.name}-{i}", node="g1", gpu_indices=tuple(range(ps.gpus_per_pod)))
                            for ps in spec.pod_sets for i in range(ps.count)]
                templates = placed_templates(kind.pod_sets(created), spec, bindings, None)
                await api.patch(res, created["metadata"]["name"], kind.run_patch(created, templates), namespace=NS)
                running.append(RunningJob(spec.job_id, job_label(spec.job_id), bindings, NS))
        fake.settle_now()
        pods = await kube_api.pods(NS)
    finally:
        await api.close()
    assert len(running) == 4
    view = placements(running, pods)
    # Every pod the controllers made (a RayCluster's head and workers, a JobSet's child Jobs' pods...) is found,
    # as the job whose templates it came from.
    assert {(NS, p["metadata"]["name"]) for p in pods} == set(view.pods)
    for job in running:
        mine = [p for p in pods if p["metadata"]["labels"].get(JOB_LABEL) == job.job_label]
        assert len(mine) == len(job.bindings) and all(view.pods[(NS, p["metadata"]["name"])] == job.job_id
                                                      for p in mine), job.job_id
    # dcgm-exporter names those pods on their GPUs (two GPUs each, on a node of its own): all exact, either form.
    devices, nodes = [], {}
    for i, p in enumerate(sorted(pods, key=lambda p: p["metadata"]["name"])):
        nodes[f"h{i}"] = node(f"h{i}", gpus=4)
        devices += [(gpu(f"h{i}", g, pod=(NS, p["metadata"]["name"]), exported=bool(i % 2)), busy(0.5)) for g in (0, 1)]
    out = attribute(parse_results(results(devices), DcgmLabels()), view, nodes)
    owners = {b.node: {s.job_id for s in b.samples} for b in out.batches}
    for i, p in enumerate(sorted(pods, key=lambda p: p["metadata"]["name"])):
        assert owners[f"h{i}"] == {view.pods[(NS, p["metadata"]["name"])]}
    assert (out.exact, out.approximate, out.unattributed) == (2 * len(pods), 0, 0)


QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 16}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")


def quick_job() -> Any:
    container = {"name": "trainer", "image": "ghcr.io/example/train:1",
                 "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "4", "memory": "8Gi"}}}
    return JOB({"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": "quick", "namespace": NS, "labels": {"gpuq.io/queue": "team-a"}},
                "spec": {"suspend": True, "completions": 1, "parallelism": 1, "backoffLimit": 0,
                         "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}})


async def test_an_unreachable_prometheus_is_said_jobs_run_on_and_verdicts_outlive_restarts_not_the_source(
        fresh: tuple[str, str], kube_api: Any, caplog: pytest.LogCaptureFixture) -> None:
    nats_url, database_url = fresh
    for name in ("n1", "n2"):
        kube_api.fake.add_node(name, gpus=8, gpu_product=H100)
    await kube_api.create_namespace(NS)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    dcgm = DcgmSettings(prometheus_url=dead, interval_s=1, timeout_s=1)
    caplog.set_level("ERROR", logger="gpuq.executor.dcgm")

    def stack(source: DcgmSettings | None) -> Any:
        return kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig, dcgm=source)

    async def health(name: str) -> str | None:
        raw = await fetchval(database_url, "SELECT spec FROM scheduler.nodes WHERE name = $1", name)
        return json.loads(raw)["health"] if raw else None

    async with kube_api.autopilot():
        async with stack(dcgm):
            await kube_api.client().create(quick_job())
            await kube_api.run_pods_to_ready(NS, "gpuq.io/job", count=1)
            await kube_api.complete_pods(NS, "gpuq.io/job")
            await eventually("JobCompleted without Prometheus", lambda: bus_events(nats_url, "job.completed"))
            checked = await eventually("a failed poll reported", lambda: fetchval(
                database_url, "SELECT count(*) FROM executor.outbox WHERE subject = $1 "
                "AND convert_from(body, 'UTF8')::jsonb #>> '{data,reason}' = 'Unreachable'",
                UtilizationSourceChecked.subject()))
            assert checked >= 1
        errors = [r.getMessage() for r in caplog.records if r.name == "gpuq.executor.dcgm"]
        assert errors and f"cannot reach Prometheus at {dead}" in errors[0] and "scheduling continues" in errors[0]
        assert len(errors) <= 2  # once per outage, not once per poll

        # The source had degraded n2 before a restart (its health table, as it writes it).
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute("INSERT INTO executor.gpu_health(node, reason, message, since) "
                               "VALUES ('n2', 'Xid79', 'XID 79 (GPU has fallen off the bus) on GPU 3', 0)")
        finally:
            await conn.close()
        async with stack(dcgm):  # the first announcement after the restart carries the verdict
            assert await eventually("n2 announced degraded", lambda: _is(health("n2"), "degraded"))
            assert await health("n1") == "ready"
        async with stack(None):  # without the source, nothing keeps n2 out: it is announced as the cluster has it
            assert await eventually("n2 announced ready", lambda: _is(health("n2"), "ready"))
        conn = await asyncpg.connect(database_url)
        try:  # the verdict stays for the source to clear, should it come back
            assert list(await degraded_nodes(conn, "executor")) == ["n2"]
        finally:
            await conn.close()


async def _is(value: Awaitable[str | None], expected: str) -> bool:
    return await value == expected


async def test_the_inventory_announces_verdicts_and_learns_what_the_source_announced(
        fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    kube_api.fake.add_node("n1", gpus=8, gpu_product=H100)
    cfg = kube_cluster().kube
    async with kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig, ("executor",)):
        await eventually("n1 announced", lambda: fetchval(database_url, "SELECT count(*) FROM executor.kube_nodes"))
    ready = copy.deepcopy(kube_api.fake.store.get(NODES, None, "n1"))
    not_ready = copy.deepcopy(ready)
    not_ready["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    verdict = {"n1": ("Xid79", "XID 79 (GPU has fallen off the bus) on GPU 3")}
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            tx = Tx(conn=conn, now=0.0, source="test", schema="executor")
            # A Node update while the source holds a verdict: announced degraded, once.
            assert await inventory.publish_node(tx, ready, cfg, deleted=False, degraded=verdict) == []
            assert await inventory.publish_node(tx, ready, cfg, deleted=False, degraded=verdict) == []
            assert [e.event().data["node"]["health"] for e in tx.emitted] == ["degraded"]
            # The source announces n1 as the informer's cache has it, which already says NotReady (its watch event
            # is still queued): the executor learns the node became unusable here, and its jobs are dealt with.
            failed = inventory.specs([not_ready], cfg)["n1"]
            assert failed.health is NodeHealth.FAILED
            assert await inventory.record(tx, failed) == ["n1"]
            assert await inventory.record(tx, failed) == []
            # The queued watch event then changes nothing more.
            assert await inventory.publish_node(tx, not_ready, cfg, deleted=False, degraded=verdict) == []
            assert len(tx.emitted) == 1
            # Ready again in the cluster, still faulty for the source: degraded, not ready.
            assert await inventory.publish_node(tx, ready, cfg, deleted=False, degraded=verdict) == []
            assert tx.emitted[-1].event().data["node"]["health"] == "degraded"
    finally:
        await conn.close()
