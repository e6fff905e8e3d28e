"""One module per workload kind; importing this package registers them all."""

from services.executor.kube.core.kinds import job, jobset, pytorchjob, rayjob

__all__ = ["job", "jobset", "pytorchjob", "rayjob"]
