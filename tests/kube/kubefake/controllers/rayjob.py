"""KubeRay's RayJob and RayCluster controllers (ray.io/v1), reduced to what gpuq observes: the head and worker pods.

A running RayJob owns a RayCluster `<rayjob>-raycluster-<random>` (status.rayClusterName), whose pods are
`<cluster>-head-<random>` and `<cluster>-<group>-worker-<random>` labelled `ray.io/cluster`, `ray.io/node-type`
(head|worker), `ray.io/group` (headgroup|<groupName>), `ray.io/is-ray-node: yes`. status.jobDeploymentStatus moves
Initializing → Running (head pod ready) → Complete|Failed, with jobStatus PENDING/RUNNING/SUCCEEDED/FAILED; the job's
outcome is the head pod's (it exits 0 or not) or `finish(...)`. spec.suspend deletes the RayCluster (Suspended);
resuming creates a new one. shutdownAfterJobFinishes deletes the cluster when the job ends.
Not emulated: the submitter Job and the Ray dashboard, autoscaling, retries (backoffLimit), deletion policies."""

from __future__ import annotations

import uuid

from ..resources import PODS, RAYCLUSTERS, RAYJOBS
from ..store import Obj
from .common import WorkloadController, create_from_template, is_active, is_ready, owned, write_status

TERMINAL = ("Complete", "Failed")


class RayJobController(WorkloadController):
    resource = RAYJOBS

    def sync_all(self) -> None:
        for cluster in self.store.list(RAYCLUSTERS):
            if not cluster["metadata"].get("deletionTimestamp"):
                self._sync_cluster(cluster)
        super().sync_all()

    def sync(self, job: Obj) -> None:
        status = job.get("status") or {}
        clusters = [c for c in owned(self.store, RAYCLUSTERS, job) if not c["metadata"].get("deletionTimestamp")]
        now = self.store.clock.stamp()
        if status.get("jobDeploymentStatus") in TERMINAL:
            if job["spec"].get("shutdownAfterJobFinishes"):
                self._delete_clusters(clusters)
            return
        if job["spec"].get("suspend"):
            self._delete_clusters(clusters)

            def suspended(s: Obj) -> None:
                s["jobDeploymentStatus"] = "Suspended"
                s.pop("jobStatus", None)
                s.pop("rayClusterName", None)
                s.pop("startTime", None)

            write_status(self.store, RAYJOBS, job, suspended)
            return
        if not clusters:
            name = f"{job['metadata']['name']}-raycluster-{uuid.uuid4().hex[:5]}"
            cluster_spec = job["spec"].get("rayClusterSpec") or {}
            create_from_template(
                self.store,
                RAYCLUSTERS,
                job,
                {"spec": cluster_spec},
                name=name,
                labels={
                    "ray.io/originated-from-crd": "RayJob",
                    "ray.io/originated-from-cr-name": job["metadata"]["name"],
                },
            )

            def initializing(s: Obj) -> None:
                s["jobDeploymentStatus"] = "Initializing"
                s["jobStatus"] = "PENDING"
                s["rayClusterName"] = name
                s.setdefault("startTime", now)

            write_status(self.store, RAYJOBS, job, initializing)
            return
        cluster = clusters[0]
        pods = owned(self.store, PODS, cluster)
        head = next((p for p in pods if p["metadata"]["labels"].get("ray.io/node-type") == "head"), None)
        if head is not None and head["status"].get("phase") in ("Succeeded", "Failed"):
            self.finish(
                job["metadata"]["namespace"], job["metadata"]["name"], succeeded=head["status"]["phase"] == "Succeeded"
            )
            return
        if head is not None and is_ready(head):
            write_status(
                self.store, RAYJOBS, job, lambda s: s.update(jobDeploymentStatus="Running", jobStatus="RUNNING")
            )

    def finish(self, namespace: str, name: str, *, succeeded: bool = True, message: str | None = None) -> None:
        """The entrypoint ended (as the Ray dashboard would report it)."""
        now = self.store.clock.stamp()

        def finished(s: Obj) -> None:
            s["jobDeploymentStatus"] = "Complete" if succeeded else "Failed"
            s["jobStatus"] = "SUCCEEDED" if succeeded else "FAILED"
            s["endTime"] = now
            if message:
                s["message"] = message
            if not succeeded:
                s["reason"] = "AppFailed"

        job = self.store.get(RAYJOBS, namespace, name)
        write_status(self.store, RAYJOBS, job, finished)

    def _delete_clusters(self, clusters: list[Obj]) -> None:
        for cluster in clusters:
            self.store.delete(
                RAYCLUSTERS, cluster["metadata"]["namespace"], cluster["metadata"]["name"], propagation="Background"
            )

    def _sync_cluster(self, cluster: Obj) -> None:
        name = cluster["metadata"]["name"]
        spec = cluster.get("spec") or {}
        pods = [
            p
            for p in owned(self.store, PODS, cluster)
            if is_active(p) or p["status"].get("phase") in ("Succeeded", "Failed")
        ]
        groups = [("headgroup", "head", 1, (spec.get("headGroupSpec") or {}).get("template") or {})]
        for group in spec.get("workerGroupSpecs") or []:
            groups.append((group["groupName"], "worker", int(group.get("replicas", 1)), group.get("template") or {}))
        for group_name, node_type, replicas, template in groups:
            have = [p for p in pods if p["metadata"]["labels"].get("ray.io/group") == group_name]
            prefix = f"{name}-head-" if node_type == "head" else f"{name}-{group_name}-worker-"
            for _ in range(replicas - len(have)):
                labels = {
                    "ray.io/cluster": name,
                    "ray.io/node-type": node_type,
                    "ray.io/group": group_name,
                    "ray.io/is-ray-node": "yes",
                    "app.kubernetes.io/name": "kuberay",
                    "app.kubernetes.io/created-by": "kuberay-operator",
                }
                create_from_template(self.store, PODS, cluster, template, generate_name=prefix, labels=labels)
        ready = sum(1 for p in pods if is_ready(p))
        head_ready = any(is_ready(p) for p in pods if p["metadata"]["labels"].get("ray.io/node-type") == "head")
        write_status(
            self.store,
            RAYCLUSTERS,
            cluster,
            lambda s: s.update(
                readyWorkerReplicas=max(0, ready - int(head_ready)),
                state="ready" if head_ready else "unhealthy" if pods else "",
            ),
        )
