"""The LeaderWorkerSet controller (leaderworkerset.x-k8s.io/v1), reduced to what gpuq observes: the groups' pods.

The real controller runs a leader StatefulSet `<lws>` (pods `<lws>-<group>`) and, per group, a worker StatefulSet
`<lws>-<group>` (pods `<lws>-<group>-<worker>`, worker 1..size-1). The fake makes those pods itself (no StatefulSet
objects), named as they would be, from `leaderTemplate` (else `workerTemplate`) and `workerTemplate`, labelled
`leaderworkerset.sigs.k8s.io/name`, `group-index`, `worker-index` and `group-key`, with the env LWS_LEADER_ADDRESS,
LWS_GROUP_SIZE and LWS_WORKER_INDEX. Groups at or above `spec.replicas` are deleted (replicas 0: none); a pod that
ended is made again. Status: replicas (groups with pods), readyReplicas (groups whose pods are all Ready), condition
Available. Not emulated: the StatefulSets and headless Service, rolling updates (`rolloutStrategy`, maxSurge),
`startupPolicy: LeaderReady`, `restartPolicy: RecreateGroupOnPodRestart`, subgroups, exclusive placement."""

from __future__ import annotations

from ..resources import LEADERWORKERSETS, PODS
from ..store import Obj
from .common import (
    WorkloadController,
    create_from_template,
    delete_pods,
    env_var,
    is_active,
    is_ready,
    owned,
    set_status_condition,
    write_status,
)

PREFIX = "leaderworkerset.sigs.k8s.io/"


class LeaderWorkerSetController(WorkloadController):
    resource = LEADERWORKERSETS

    def sync(self, lws: Obj) -> None:
        name = lws["metadata"]["name"]
        spec = lws["spec"]
        lwt = spec.get("leaderWorkerTemplate") or {}
        replicas, size = int(spec.get("replicas", 1)), max(1, int(lwt.get("size", 1)))
        pods = [p for p in owned(self.store, PODS, lws) if not p["metadata"].get("deletionTimestamp")]
        by_name = {p["metadata"]["name"]: p for p in pods}
        wanted = {f"{name}-{g}" if w == 0 else f"{name}-{g}-{w}": (g, w) for g in range(replicas) for w in range(size)}
        delete_pods(self.store, [p for n, p in by_name.items() if n not in wanted or not is_active(p)])
        live = {n: p for n, p in by_name.items() if n in wanted and is_active(p)}
        for pod_name, (group, worker) in sorted(wanted.items()):
            if pod_name not in live:
                live[pod_name] = self._create(lws, pod_name, group, worker, size)
        groups: dict[int, list[Obj]] = {}
        for pod_name, pod in live.items():
            groups.setdefault(wanted[pod_name][0], []).append(pod)
        ready = sum(1 for g in groups.values() if len(g) == size and all(is_ready(p) for p in g))
        now = self.store.clock.stamp()

        def status(s: Obj) -> None:
            s["replicas"], s["readyReplicas"] = len(groups), ready
            available = "True" if replicas and ready == replicas else "False"
            set_status_condition(s, "Available", available, "AllGroupsReady" if available == "True" else
                                 "GroupsNotReady", None, now)

        write_status(self.store, LEADERWORKERSETS, lws, status)

    def _create(self, lws: Obj, pod_name: str, group: int, worker: int, size: int) -> Obj:
        name = lws["metadata"]["name"]
        lwt = lws["spec"].get("leaderWorkerTemplate") or {}
        template = (lwt.get("leaderTemplate") or lwt.get("workerTemplate")) if worker == 0 \
            else lwt.get("workerTemplate")
        labels = {f"{PREFIX}name": name, f"{PREFIX}group-index": str(group), f"{PREFIX}worker-index": str(worker),
                  f"{PREFIX}group-key": f"{name}-{group}"}

        def env(pod_spec: Obj) -> None:
            for c in pod_spec.get("containers") or []:
                env_var(c, "LWS_LEADER_ADDRESS", f"{name}-{group}.{name}.{lws['metadata']['namespace']}")
                env_var(c, "LWS_GROUP_SIZE", str(size))
                env_var(c, "LWS_WORKER_INDEX", str(worker))

        return create_from_template(self.store, PODS, lws, template or {}, name=pod_name, labels=labels,
                                    mutate_spec=env)
