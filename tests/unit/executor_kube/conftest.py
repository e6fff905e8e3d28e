"""Fixtures shared by the Kubernetes executor's pure tests: objects shaped as the API returns them."""

from __future__ import annotations

from typing import Any

import pytest

from shared.config import KubernetesSource, QueuesConfig, parse_queues

QUEUES = {
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "normal", "value": 100}, {"name": "low", "value": 0}],
    "cohorts": [{"name": "research"}],
    "queues": [{"name": "team-a", "cohort": "research", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 16}}},
               {"name": "team-b", "cohort": "research", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 16}}}],
    "namespaces": [{"name": "ml-a", "team": "team-a", "queues": ["team-a"]},
                   {"name": "ml-b", "team": "team-b", "queues": ["team-b"]}],
    "kubernetes_priority_classes": {"research-high": "high"},
}


@pytest.fixture
def queues() -> QueuesConfig:
    return parse_queues(QUEUES)


@pytest.fixture
def kube_cfg() -> KubernetesSource:
    return KubernetesSource(gpu_flavors={"NVIDIA-H100-80GB-HBM3": "H100-80GB"}, pool_label="gpuq.io/pool",
                            topology_levels=("network.topology.nvidia.com/block", "network.topology.nvidia.com/rack"))


def container(gpus: int = 8, cpu: str = "16", memory: str = "64Gi", **extra: Any) -> dict[str, Any]:
    return {"name": "trainer", "image": "ghcr.io/example/train:1", **extra,
            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"cpu": cpu, "memory": memory}}}


def pod_template(gpus: int = 8, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"labels": {"app": "train"}}, "spec": {"restartPolicy": "Never", **spec,
                                                               "containers": [container(gpus)]}}


def job(name: str = "sweep", namespace: str = "ml-a", *, parallelism: int = 2, suspend: bool = True,
        labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace, "uid": "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0",
                         "labels": {"gpuq.io/queue": "team-a", **(labels or {})}, "annotations": annotations or {},
                         "creationTimestamp": "2026-11-30T10:00:00Z"},
            "spec": {"parallelism": parallelism, "completions": parallelism, "completionMode": "Indexed",
                     "suspend": suspend, "template": pod_template(), **spec}}


def pytorchjob(workers: int = 2, gpus: int = 8, namespace: str = "ml-a") -> dict[str, Any]:
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": "llm", "namespace": namespace, "uid": "aaaabbbb-cccc", "labels": {
                "gpuq.io/queue": "team-a"}, "annotations": {"gpuq.io/topology-required": "rack"}},
            "spec": {"runPolicy": {"suspend": True},
                     "pytorchReplicaSpecs": {"Worker": {"replicas": workers, "template": pod_template(gpus)}}}}


def node(name: str, *, gpus: int = 8, ready: str = "True", labels: dict[str, str] | None = None,
         taints: list[dict[str, str]] | None = None, unschedulable: bool = False,
         allocatable: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                                  "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                                  "nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.memory": "81559",
                                                  **(labels or {})},
                         "annotations": annotations or {}},
            "spec": {"taints": taints or [], **({"unschedulable": True} if unschedulable else {})},
            "status": {"allocatable": allocatable or {"nvidia.com/gpu": str(gpus), "cpu": "95500m",
                                                      "memory": "1056000Mi", "pods": "110"},
                       "conditions": [{"type": "MemoryPressure", "status": "False"},
                                      {"type": "Ready", "status": ready}]}}
