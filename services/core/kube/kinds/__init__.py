"""One module per workload kind; importing this package registers them all."""

from services.core.kube.kinds import (
    job,
    jobset,
    leaderworkerset,
    mpijob,
    notebook,
    pytorchjob,
    rayjob,
    statefulset,
    tfjob,
)
from services.core.kube.workload import WorkloadKind, every_registered, registered

__all__ = ["all_kinds", "job", "jobset", "kind_of", "leaderworkerset", "mpijob", "notebook", "pytorchjob", "rayjob",
           "statefulset", "tfjob"]


# The lookups live here, above the kinds they find: importing this package has registered every kind, and the
# registry (workload.py) imports none of them.
def kind_of(api_version: str, kind: str) -> WorkloadKind | None:
    return registered(api_version, kind)


def all_kinds() -> list[WorkloadKind]:
    return every_registered()
