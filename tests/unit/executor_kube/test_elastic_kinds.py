"""Elastic workloads on Kubernetes (issue 48 item 2): a PyTorchJob's elasticPolicy and a RayJob's autoscaling range
become an elastic pod set (PodSet.min_count); the run patch runs the pods placed and tells the pods how many
(annotations the SDK reads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gpuq_sdk
from services.core.kube import names as n
from services.core.kube.elastic import pod_notice, resize_patch, run_elastic
from services.core.kube.intake import job_spec
from services.core.kube.kinds import kind_of
from shared.config import KubernetesSource, QueuesConfig
from shared.domain import GpuBinding, JobSpec
from tests.unit.executor_kube.conftest import pod_template, pytorchjob

PT = kind_of("kubeflow.org/v1", "PyTorchJob")
RAY = kind_of("ray.io/v1", "RayJob")


def elastic_pytorchjob(min_replicas: int = 2, max_replicas: int = 6, replicas: int = 4) -> dict[str, Any]:
    obj = pytorchjob(workers=replicas, gpus=1)
    obj["metadata"]["annotations"] = {}
    obj["spec"]["elasticPolicy"] = {"minReplicas": min_replicas, "maxReplicas": max_replicas, "rdzvBackend": "c10d"}
    return obj


def rayjob(autoscaling: bool) -> dict[str, Any]:
    return {"apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": "tune", "namespace": "ml-a", "uid": "ray-uid", "labels": {"gpuq.io/queue": "team-a"}},
            "spec": {"suspend": True, "rayClusterSpec": {
                "enableInTreeAutoscaling": autoscaling,
                "headGroupSpec": {"template": pod_template(0)},
                "workerGroupSpecs": [{"groupName": "gpu", "replicas": 2, "minReplicas": 1, "maxReplicas": 5,
                                      "template": pod_template(1)}]}}}


def test_a_pytorchjob_elastic_policy_is_an_elastic_worker_pod_set(queues: QueuesConfig,
                                                                  kube_cfg: KubernetesSource) -> None:
    assert PT is not None
    spec = job_spec(PT, elastic_pytorchjob(), queues, kube_cfg)
    assert isinstance(spec, JobSpec), spec
    [worker] = spec.pod_sets
    assert (worker.name, worker.count, worker.min_count) == ("worker", 6, 2)  # maxReplicas..minReplicas
    fixed = job_spec(PT, pytorchjob(workers=4, gpus=1), queues, kube_cfg)
    assert isinstance(fixed, JobSpec) and not fixed.elastic and fixed.pod_sets[0].count == 4


def test_a_rayjob_autoscaling_range_is_elastic_only_with_the_autoscaler_on(queues: QueuesConfig,
                                                                          kube_cfg: KubernetesSource) -> None:
    assert RAY is not None
    on = job_spec(RAY, rayjob(True), queues, kube_cfg)
    off = job_spec(RAY, rayjob(False), queues, kube_cfg)
    assert isinstance(on, JobSpec) and isinstance(off, JobSpec)
    assert [(p.name, p.count, p.min_count) for p in on.pod_sets] == [("head", 1, None), ("gpu", 5, 1)]
    assert [(p.name, p.count, p.min_count) for p in off.pod_sets] == [("head", 1, None), ("gpu", 2, None)]
    patch = RAY.replicas_patch(rayjob(True), {"gpu": 3})
    assert patch["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 3


def test_the_run_patch_runs_the_pods_placed_and_annotates_workload_and_pods(queues: QueuesConfig,
                                                                           kube_cfg: KubernetesSource) -> None:
    assert PT is not None
    obj = elastic_pytorchjob()
    spec = job_spec(PT, obj, queues, kube_cfg)
    assert isinstance(spec, JobSpec)
    bindings = [GpuBinding(pod=f"worker-{i}", node="n1", gpu_indices=(i,)) for i in range(3)]
    patch = run_elastic(PT, obj, spec, bindings, {"worker": {"metadata": {}, "spec": {}}})
    assert patch["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    assert patch["spec"]["runPolicy"]["suspend"] is False
    notes = {n.TARGET_PODS_ANNOTATION: "3", n.TARGET_PODS_BY_SET_ANNOTATION: "worker=3"}
    assert patch["metadata"]["annotations"] == notes
    assert patch["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["annotations"] == notes
    assert resize_patch(PT, obj, spec, {"worker": 5})["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 5
    assert pod_notice(spec, {"worker": 5}) == {"metadata": {"annotations": {
        n.TARGET_PODS_ANNOTATION: "5", n.TARGET_PODS_BY_SET_ANNOTATION: "worker=5"}}}
    fixed = job_spec(PT, pytorchjob(workers=2, gpus=1), queues, kube_cfg)
    assert isinstance(fixed, JobSpec) and resize_patch(PT, obj, fixed, {"worker": 1}) == {}


def test_the_sdk_reads_the_target_size(tmp_path: Path) -> None:
    path = tmp_path / "annotations"
    assert gpuq_sdk.target_pods(path) is None and gpuq_sdk.target_pods_by_set(path) == {}
    path.write_text('gpuq.io/target-pods="5"\ngpuq.io/target-pods-by-set="worker=5"\n')
    assert gpuq_sdk.target_pods(path) == 5
    assert gpuq_sdk.target_pods_by_set(path) == {"worker": 5}
    assert (gpuq_sdk.TARGET_PODS, gpuq_sdk.TARGET_PODS_BY_SET) == (n.TARGET_PODS_ANNOTATION,
                                                                  n.TARGET_PODS_BY_SET_ANNOTATION)


def test_the_producer_sdk_asks_for_an_elastic_pod_set() -> None:
    from gpuq_sdk.client import job_spec as sdk_job_spec

    body = sdk_job_spec(gpus=1, pods=8, min_pods=2, team="team-a", queue="team-a", job_id="j")
    assert body["pod_sets"] == [{"count": 8, "gpus_per_pod": 1, "min_count": 2}]
    spec = JobSpec.model_validate(body)
    assert spec.elastic and spec.min_pods == 2 and spec.total_pods == 8
