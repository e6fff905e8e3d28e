"""The workload controllers the tests play: batch/v1 Job, JobSet, PyTorchJob, RayJob."""

from __future__ import annotations

from typing import Protocol

from ..store import Store
from .job import JobController
from .jobset import JobSetController
from .pytorchjob import PyTorchJobController
from .rayjob import RayJobController


class Controller(Protocol):
    def reconcile(self) -> bool:
        """One pass over the controller's objects; True when it changed anything."""
        ...


def all_controllers(store: Store) -> list[Controller]:
    """In dependency order: JobSet makes Jobs, Jobs make pods; RayJob makes a RayCluster, which makes pods."""
    return [JobSetController(store), JobController(store), PyTorchJobController(store), RayJobController(store)]


__all__ = [
    "Controller",
    "JobController",
    "JobSetController",
    "PyTorchJobController",
    "RayJobController",
    "all_controllers",
]
