"""The workload controllers the tests play: batch/v1 Job, JobSet, PyTorchJob, RayJob."""

from __future__ import annotations

from typing import Protocol

from ..store import Store
from .job import JobController
from .pytorchjob import PyTorchJobController


class Controller(Protocol):
    def reconcile(self) -> bool:
        """One pass over the controller's objects; True when it changed anything."""
        ...


def all_controllers(store: Store) -> list[Controller]:
    return [JobController(store), PyTorchJobController(store)]


__all__ = ["Controller", "JobController", "PyTorchJobController", "all_controllers"]
