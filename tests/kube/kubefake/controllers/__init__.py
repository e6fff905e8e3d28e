"""The controllers the tests play: batch/v1 Job, JobSet, PyTorchJob (and TFJob, MPIJob), RayJob, Kubeflow's
Notebook, LeaderWorkerSet, StatefulSet, and the resourceclaim controller (a pod's ResourceClaims from its
ResourceClaimTemplates)."""

from __future__ import annotations

from typing import Protocol

from ..store import Store
from .job import JobController
from .jobset import JobSetController
from .leaderworkerset import LeaderWorkerSetController
from .notebook import NotebookController
from .pytorchjob import MPIJobController, PyTorchJobController, TFJobController
from .rayjob import RayJobController
from .resourceclaim import ResourceClaimController
from .statefulset import StatefulSetController


class Controller(Protocol):
    def reconcile(self) -> bool:
        """One pass over the controller's objects; True when it changed anything."""
        ...


def all_controllers(store: Store) -> list[Controller]:
    """In dependency order: JobSet makes Jobs, Jobs make pods; RayJob makes a RayCluster, which makes pods; pods'
    ResourceClaims come last."""
    return [JobSetController(store), JobController(store), PyTorchJobController(store), TFJobController(store),
            MPIJobController(store), RayJobController(store), NotebookController(store),
            LeaderWorkerSetController(store), StatefulSetController(store),
            ResourceClaimController(store)]


__all__ = [
    "Controller",
    "JobController",
    "JobSetController",
    "LeaderWorkerSetController",
    "MPIJobController",
    "NotebookController",
    "PyTorchJobController",
    "RayJobController",
    "ResourceClaimController",
    "StatefulSetController",
    "TFJobController",
    "all_controllers",
]
