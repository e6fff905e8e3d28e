"""The Kubeflow training-operator's PyTorchJob controller (kubeflow.org/v1), as far as gpuq observes it.

Pods `<job>-master-0`, `<job>-worker-<i>` (one per replica of each pytorchReplicaSpec) with a headless Service of
the same name, labelled `training.kubeflow.org/job-name`, `.../replica-type` (lower case), `.../replica-index`,
`.../operator-name: pytorchjob-controller` and `.../job-role: master` on the master; env MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK, PYTHONUNBUFFERED on every container that does not set them.
`runPolicy.suspend` deletes the pods and sets Suspended=True (PyTorchJobSuspended); resuming sets it False
(PyTorchJobResumed), clears startTime and recreates the pods from the templates as they are then.
Conditions Created, Running (any pod running), Succeeded (the master, or every worker without a master),
Failed (a pod failed under restartPolicy Never/ExitCode; restarts beyond runPolicy.backoffLimit; or
runPolicy.activeDeadlineSeconds passed), all with the `PyTorchJob<Type>` reasons of the real operator.
runPolicy.cleanPodPolicy (default None) decides which pods are deleted once the job finished.
Not emulated: elastic policy, ExitCode restart classification, the gang-scheduler PodGroup, TTL."""

from __future__ import annotations

from ..resources import MPIJOBS, PODS, PYTORCHJOBS, SERVICES, TFJOBS, ResourceType
from ..store import Obj
from .common import (
    WorkloadController,
    condition_true,
    create_from_template,
    delete_pods,
    env_var,
    is_active,
    owned,
    set_status_condition,
    write_status,
)

LABEL_PREFIX = "training.kubeflow.org"
OPERATOR_NAME = "pytorchjob-controller"
DEFAULT_PORT = 23456
REPLICA_ORDER = ("Master", "Worker")


def _master_port(job: Obj, key: str = "pytorchReplicaSpecs") -> int:
    master = ((job["spec"].get(key) or {}).get("Master") or {}).get("template") or {}
    for container in (master.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "pytorchjob-port":
                return int(port["containerPort"])
    return DEFAULT_PORT


class PyTorchJobController(WorkloadController):
    """Also the training operator's TFJob and the mpi-operator's MPIJob (v2beta1), of the same shape here: replica
    specs under `replicas_key`, runPolicy, the kubeflow conditions with `<Kind><Type>` reasons; the job succeeds when
    its `leader` replica does (Master, Chief, Launcher), else when every replica does. Their own environment
    (TF_CONFIG, the MPI hostfile) is not written: the PyTorch variables are."""

    resource: ResourceType = PYTORCHJOBS
    kind = "PyTorchJob"
    replicas_key = "pytorchReplicaSpecs"
    replica_order: tuple[str, ...] = REPLICA_ORDER
    leader = "Master"
    operator_name = OPERATOR_NAME

    def _replica_specs(self, job: Obj) -> list[tuple[str, Obj]]:
        specs = (job.get("spec") or {}).get(self.replicas_key) or {}
        order = self.replica_order
        return sorted(specs.items(), key=lambda item: (order.index(item[0]) if item[0] in order else 9, item[0]))

    def sync(self, job: Obj) -> None:
        now = self.store.clock.stamp()
        name = job["metadata"]["name"]
        run_policy = job["spec"].get("runPolicy") or {}
        pods = owned(self.store, PODS, job)
        if not condition_true(job, "Created"):
            write_status(
                self.store,
                self.resource,
                job,
                lambda s: set_status_condition(
                    s, "Created", "True", self.kind + "Created", f"{self.kind} {name} is created.", now
                ),
            )
        if condition_true(job, "Succeeded") or condition_true(job, "Failed"):
            self._clean(job, pods, run_policy.get("cleanPodPolicy") or "None")
            return
        if run_policy.get("suspend"):
            delete_pods(self.store, [p for p in pods if is_active(p)])
            for service in owned(self.store, SERVICES, job):
                self.store.delete(SERVICES, service["metadata"]["namespace"], service["metadata"]["name"])

            def suspended(s: Obj) -> None:
                if not condition_true({"status": s}, "Suspended"):
                    set_status_condition(
                        s, "Suspended", "True", self.kind + "Suspended", f"{self.kind} {name} is suspended.", now
                    )
                    set_status_condition(
                        s, "Running", "False", self.kind + "Suspended", f"{self.kind} {name} is suspended.", now
                    )
                s.pop("startTime", None)
                s["replicaStatuses"] = {rtype: {} for rtype, _ in self._replica_specs(job)}

            write_status(self.store, self.resource, job, suspended)
            return
        if condition_true(job, "Suspended"):
            write_status(
                self.store,
                self.resource,
                job,
                lambda s: set_status_condition(
                    s, "Suspended", "False", self.kind + "Resumed", f"{self.kind} {name} is resumed.", now
                ),
            )
        write_status(self.store, self.resource, job, lambda s: s.setdefault("startTime", now))
        job = self.store.get(self.resource, job["metadata"]["namespace"], name)
        failure = self._failure(job, pods)
        if failure is not None:
            delete_pods(self.store, [p for p in pods if is_active(p)])
            write_status(
                self.store, self.resource, job,
                lambda s: self._finished(s, "Failed", self.kind + "Failed", failure, now),
            )
            return
        self._create_missing(job, pods)
        self._delete_excess(job, owned(self.store, PODS, job))
        pods = owned(self.store, PODS, job)
        self._write_status(job, pods, now)

    def _failure(self, job: Obj, pods: list[Obj]) -> str | None:
        run_policy = job["spec"].get("runPolicy") or {}
        name = job["metadata"]["name"]
        deadline = run_policy.get("activeDeadlineSeconds")
        started = (job.get("status") or {}).get("startTime")
        if deadline is not None and started and self.store.clock.seconds_since(started) >= int(deadline):
            return f"{self.kind} {name} has failed because it was active longer than specified deadline"
        for pod in pods:
            if pod["status"].get("phase") == "Failed" and not pod["metadata"].get("deletionTimestamp"):
                rtype = pod["metadata"]["labels"].get(f"{LABEL_PREFIX}/replica-type", "")
                return f"{self.kind} {name} is failed because 1 {rtype.capitalize()} replica(s) failed."
        restarts = sum(
            int(s.get("restartCount") or 0) for p in pods for s in p["status"].get("containerStatuses") or []
        )
        limit = run_policy.get("backoffLimit")
        if limit is not None and restarts > int(limit):
            return f"{self.kind} {name} has failed because it has reached the specified backoff limit"
        return None

    def _create_missing(self, job: Obj, pods: list[Obj]) -> None:
        name = job["metadata"]["name"]
        existing = {p["metadata"]["name"] for p in pods}
        services = {s["metadata"]["name"] for s in owned(self.store, SERVICES, job)}
        specs = self._replica_specs(job)
        world = sum(int(spec.get("replicas", 1)) for _, spec in specs)
        has_master = any(rtype == self.leader for rtype, _ in specs)
        port = _master_port(job, self.replicas_key)
        for rtype, spec in specs:
            for index in range(int(spec.get("replicas", 1))):
                pod_name = f"{name}-{rtype.lower()}-{index}"
                labels = {
                    f"{LABEL_PREFIX}/job-name": name,
                    f"{LABEL_PREFIX}/operator-name": self.operator_name,
                    f"{LABEL_PREFIX}/replica-type": rtype.lower(),
                    f"{LABEL_PREFIX}/replica-index": str(index),
                }
                if rtype == self.leader:
                    labels[f"{LABEL_PREFIX}/job-role"] = "master"
                if pod_name in existing:
                    continue
                rank = index if rtype == self.leader or not has_master else index + 1
                restart = spec.get("restartPolicy", "OnFailure")

                def fill(pod_spec: Obj, rank: int = rank, restart: str = restart) -> None:
                    pod_spec["restartPolicy"] = "Never" if restart == "ExitCode" else restart
                    master_addr = f"{name}-master-0" if has_master else "localhost"
                    for container in pod_spec.get("containers") or []:
                        env_var(container, "MASTER_PORT", str(port))
                        env_var(container, "MASTER_ADDR", master_addr)
                        env_var(container, "WORLD_SIZE", str(world))
                        env_var(container, "RANK", str(rank))
                        env_var(container, "PYTHONUNBUFFERED", "1")

                create_from_template(
                    self.store, PODS, job, spec.get("template") or {}, name=pod_name, labels=labels, mutate_spec=fill
                )
                if pod_name not in services:
                    create_from_template(
                        self.store,
                        SERVICES,
                        job,
                        {
                            "spec": {
                                "clusterIP": "None",
                                "selector": labels,
                                "ports": [{"name": "pytorchjob-port", "port": port}],
                            }
                        },
                        name=pod_name,
                        labels=labels,
                    )

    def _delete_excess(self, job: Obj, pods: list[Obj]) -> None:
        """Pods whose replica index is not below their type's replicas any more go (the operator's reconcile: an
        elastic job's Worker replicas lowered)."""
        replicas = {rtype.lower(): int(spec.get("replicas", 1)) for rtype, spec in self._replica_specs(job)}
        delete_pods(self.store, [
            p for p in pods
            if int(p["metadata"]["labels"].get(f"{LABEL_PREFIX}/replica-index", "0"))
            >= replicas.get(p["metadata"]["labels"].get(f"{LABEL_PREFIX}/replica-type", ""), 1 << 30)])

    def _write_status(self, job: Obj, pods: list[Obj], now: str) -> None:
        name = job["metadata"]["name"]
        specs = self._replica_specs(job)
        by_type: dict[str, list[Obj]] = {rtype: [] for rtype, _ in specs}
        for pod in pods:
            rtype = pod["metadata"]["labels"].get(f"{LABEL_PREFIX}/replica-type", "")
            for known in by_type:
                if known.lower() == rtype:
                    by_type[known].append(pod)
        done = False
        if self.leader in by_type:
            done = any(p["status"].get("phase") == "Succeeded" for p in by_type[self.leader])
        elif by_type:
            done = all(
                sum(1 for p in by_type[rtype] if p["status"].get("phase") == "Succeeded")
                >= int(spec.get("replicas", 1))
                for rtype, spec in specs
            )
        running = any(p["status"].get("phase") == "Running" for p in pods)

        def status(s: Obj) -> None:
            s["replicaStatuses"] = {
                rtype: {
                    k: v
                    for k, v in {
                        "active": sum(
                            1
                            for p in group
                            if p["status"].get("phase") in ("Pending", "Running")
                            and not p["metadata"].get("deletionTimestamp")
                        ),
                        "succeeded": sum(1 for p in group if p["status"].get("phase") == "Succeeded"),
                        "failed": sum(1 for p in group if p["status"].get("phase") == "Failed"),
                    }.items()
                    if v
                }
                for rtype, group in by_type.items()
            }
            if done:
                self._finished(
                    s, "Succeeded", self.kind + "Succeeded", f"{self.kind} {name} is successfully completed.", now
                )
            elif running:
                set_status_condition(s, "Running", "True", self.kind + "Running", f"{self.kind} {name} is running.",
                                     now)

        write_status(self.store, self.resource, job, status)
        if done:
            job = self.store.get(self.resource, job["metadata"]["namespace"], name)
            self._clean(
                job, owned(self.store, PODS, job), (job["spec"].get("runPolicy") or {}).get("cleanPodPolicy") or "None"
            )

    @staticmethod
    def _finished(s: Obj, kind: str, reason: str, message: str, now: str) -> None:
        set_status_condition(s, "Running", "False", reason, message, now)
        set_status_condition(s, kind, "True", reason, message, now)
        s.setdefault("completionTime", now)

    def _clean(self, job: Obj, pods: list[Obj], policy: str) -> None:
        if policy == "All":
            delete_pods(self.store, pods)
        elif policy == "Running":
            delete_pods(self.store, [p for p in pods if is_active(p)])


class TFJobController(PyTorchJobController):
    resource = TFJOBS
    kind = "TFJob"
    replicas_key = "tfReplicaSpecs"
    replica_order = ("Chief", "Master", "PS", "Worker", "Evaluator")
    leader = "Chief"
    operator_name = "tfjob-controller"


class MPIJobController(PyTorchJobController):
    resource = MPIJOBS
    kind = "MPIJob"
    replicas_key = "mpiReplicaSpecs"
    replica_order = ("Launcher", "Worker")
    leader = "Launcher"
    operator_name = "mpi-operator"
