"""Kubeflow `kubeflow.org/v1` TFJob (training-operator): one pod set per replica type under `tfReplicaSpecs`
(Chief or Master, PS, Worker, Evaluator), suspended through `runPolicy.suspend`; the same shape as PyTorchJob."""

from __future__ import annotations

from services.core.kube.kinds.pytorchjob import PyTorchJob
from services.core.kube.workload import register


class TFJob(PyTorchJob):
    api_version, kind, plural = "kubeflow.org/v1", "TFJob", "tfjobs"
    replicas_key = "tfReplicaSpecs"
    order = {"chief": 0, "master": 1, "ps": 2, "worker": 3, "evaluator": 4}


TFJOB = register(TFJob())
