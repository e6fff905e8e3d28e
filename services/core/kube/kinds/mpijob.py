"""Kubeflow `kubeflow.org/v2beta1` MPIJob (mpi-operator): one pod set per replica type under `mpiReplicaSpecs`
(Launcher, Worker), suspended through `runPolicy.suspend`; the mpi-operator writes the kubeflow common conditions
(Succeeded, Failed, and Suspended once its pods are deleted), as the training operator does for a PyTorchJob."""

from __future__ import annotations

from services.core.kube.kinds.pytorchjob import PyTorchJob
from services.core.kube.workload import register


class MPIJob(PyTorchJob):
    api_version, kind, plural = "kubeflow.org/v2beta1", "MPIJob", "mpijobs"
    replicas_key = "mpiReplicaSpecs"
    order = {"launcher": 0, "worker": 1}


MPIJOB = register(MPIJob())
