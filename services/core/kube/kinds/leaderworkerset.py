"""`leaderworkerset.x-k8s.io/v1` LeaderWorkerSet: `replicas` groups of `size` pods, each a leader (its
`leaderTemplate`, else the `workerTemplate`) and `size - 1` workers. gpuq runs the groups as one gang of two pod
sets, `leader` (one pod per group) and `worker` (`size - 1` per group).

A LeaderWorkerSet has no suspend field (Kueue runs it through its plain-pod-group integration). gpuq holds one at
zero groups: `spec.replicas: 0`, with the number of groups to run in the annotation `gpuq.io/groups` (the webhook
writes it from `replicas` when it holds a LeaderWorkerSet created running; an author creating it held writes both).
Started, it gets `replicas` back from the annotation; stopped, its controller deletes the groups. It never finishes
by itself (a serving workload); gpuq ends one by leaving it at zero groups."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from services.core.kube import names as n
from services.core.kube.kinds.scaled import HeldAtZeroReplicas, held_count
from services.core.kube.workload import Obj, PodSetTemplate, register

LEADER, WORKER = "leader", "worker"


def _lwt(obj: Obj) -> Mapping[str, Any]:
    return ((obj.get("spec") or {}).get("leaderWorkerTemplate")) or {}


def groups(obj: Obj) -> int:
    """The groups to run: the annotation while held, else `replicas` (default 1)."""
    return held_count(obj, n.GROUPS_ANNOTATION)


class LeaderWorkerSet(HeldAtZeroReplicas):
    api_version, kind, plural = "leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets"
    held_annotation = n.GROUPS_ANNOTATION

    def pod_sets(self, obj: Obj) -> list[PodSetTemplate]:
        lwt = _lwt(obj)
        count, size = max(1, groups(obj)), max(1, int(lwt.get("size", 1)))
        worker = dict(lwt.get("workerTemplate") or {})
        out = [PodSetTemplate(LEADER, count, dict(lwt.get("leaderTemplate") or worker))]
        if size > 1:
            out.append(PodSetTemplate(WORKER, count * (size - 1), worker))
        return out

    def with_templates(self, spec: dict[str, Any], templates: Mapping[str, dict[str, Any]]) -> None:
        lwt = spec.setdefault("leaderWorkerTemplate", {})
        if LEADER in templates:  # the leader's own template (a copy of the workers' when it had none)
            lwt["leaderTemplate"] = copy.deepcopy(templates[LEADER])
        if WORKER in templates:
            lwt["workerTemplate"] = copy.deepcopy(templates[WORKER])


LEADERWORKERSET = register(LeaderWorkerSet())
