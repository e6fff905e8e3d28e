"""The JobSet controller (jobset.x-k8s.io/v1alpha2), as far as gpuq observes it.

Child Jobs `<jobset>-<replicatedJob>-<index>` (Indexed by default), owned by the JobSet, labelled and annotated on
the Job and its pod template with `jobset.sigs.k8s.io/jobset-name`, `replicatedjob-name`, `replicatedjob-replicas`,
`job-index`, `job-global-index`, `job-key`, `restart-attempt`; pods get `subdomain: <jobset>` and a headless Service
`<jobset>`. suspend propagates to the child Jobs; on resume the child Jobs' pod templates first take the JobSet's
current scheduling directives (nodeSelector, tolerations, affinity, schedulingGates, labels, annotations), as the
real controller does for Kueue. Completed (successPolicy All/Any over targetReplicatedJobs) and Failed
(FailedJobs; ReachedMaxRestarts after failurePolicy.maxRestarts recreations) conditions, Suspended (SuspendedJobs /
ResumeJobs), status.replicatedJobsStatus, restarts, terminalState.
Not emulated: startupPolicy, coordinator, exclusive placement, failure policy rules, TTL, managedBy."""

from __future__ import annotations

import copy
import hashlib

from ..resources import JOBS, JOBSETS, SERVICES
from ..store import Obj
from .common import WorkloadController, condition_true, create_from_template, owned, set_status_condition, write_status

PREFIX = "jobset.sigs.k8s.io"
SCHEDULING_FIELDS = ("nodeSelector", "tolerations", "affinity", "schedulingGates")


class JobSetController(WorkloadController):
    resource = JOBSETS

    def sync(self, jobset: Obj) -> None:
        if condition_true(jobset, "Completed") or condition_true(jobset, "Failed"):
            return
        name, now = jobset["metadata"]["name"], self.store.clock.stamp()
        spec = jobset["spec"]
        suspend = bool(spec.get("suspend"))
        children = {job["metadata"]["name"]: job for job in owned(self.store, JOBS, jobset)}
        restarts = int((jobset.get("status") or {}).get("restarts") or 0)
        if any(condition_true(job, "Failed") for job in children.values()):
            self._fail_or_restart(jobset, children, restarts, now)
            return
        if not owned(self.store, SERVICES, jobset) and (spec.get("network") or {}).get("enableDNSHostnames", True):
            create_from_template(
                self.store,
                SERVICES,
                jobset,
                {"spec": {"clusterIP": "None", "selector": {f"{PREFIX}/jobset-name": name}}},
                name=name,
            )
        global_index = 0
        for replicated in spec.get("replicatedJobs") or []:
            for index in range(int(replicated.get("replicas", 1))):
                child_name = f"{name}-{replicated['name']}-{index}"
                child = children.get(child_name)
                if child is None:
                    self._create_child(jobset, replicated, index, global_index, restarts)
                elif child["metadata"].get("deletionTimestamp"):
                    pass
                elif suspend and not child["spec"].get("suspend"):
                    self.store.mutate(
                        JOBS,
                        child["metadata"]["namespace"],
                        child_name,
                        lambda j: j["spec"].__setitem__("suspend", True),
                    )
                elif not suspend and child["spec"].get("suspend"):
                    self._resume_child(child, replicated)
                global_index += 1
        self._write_status(jobset, suspend, now)

    def _labels(self, jobset: Obj, replicated: Obj, index: int, global_index: int, restarts: int) -> dict[str, str]:
        name = jobset["metadata"]["name"]
        key = hashlib.sha1(
            f"{jobset['metadata']['namespace']}/{name}-{replicated['name']}-{index}".encode()
        ).hexdigest()
        return {
            f"{PREFIX}/jobset-name": name,
            f"{PREFIX}/jobset-uid": jobset["metadata"]["uid"],
            f"{PREFIX}/replicatedjob-name": replicated["name"],
            f"{PREFIX}/replicatedjob-replicas": str(replicated.get("replicas", 1)),
            f"{PREFIX}/job-index": str(index),
            f"{PREFIX}/job-global-index": str(global_index),
            f"{PREFIX}/job-key": key,
            f"{PREFIX}/restart-attempt": str(restarts),
        }

    def _create_child(self, jobset: Obj, replicated: Obj, index: int, global_index: int, restarts: int) -> None:
        name = jobset["metadata"]["name"]
        labels = self._labels(jobset, replicated, index, global_index, restarts)
        template = copy.deepcopy(replicated.get("template") or {})
        job_spec = template.setdefault("spec", {})
        job_spec["suspend"] = bool(jobset["spec"].get("suspend"))
        pod_template = job_spec.setdefault("template", {})
        pod_meta = pod_template.setdefault("metadata", {})
        pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **labels}
        pod_meta["annotations"] = {**(pod_meta.get("annotations") or {}), **labels}
        pod_spec = pod_template.setdefault("spec", {})
        network = jobset["spec"].get("network") or {}
        if network.get("enableDNSHostnames", True):
            pod_spec.setdefault("subdomain", network.get("subdomain") or name)
        create_from_template(
            self.store,
            JOBS,
            jobset,
            template,
            name=f"{name}-{replicated['name']}-{index}",
            labels=labels,
            annotations=labels,
        )

    def _resume_child(self, child: Obj, replicated: Obj) -> None:
        source = ((replicated.get("template") or {}).get("spec") or {}).get("template") or {}

        def resume(job: Obj) -> None:
            pod_template = job["spec"].setdefault("template", {})
            pod_spec = pod_template.setdefault("spec", {})
            for field in SCHEDULING_FIELDS:
                if field in (source.get("spec") or {}):
                    pod_spec[field] = copy.deepcopy(source["spec"][field])
                else:
                    pod_spec.pop(field, None)
            meta = pod_template.setdefault("metadata", {})
            for field in ("labels", "annotations"):
                meta[field] = {**(meta.get(field) or {}), **((source.get("metadata") or {}).get(field) or {})}
            job["spec"]["suspend"] = False

        self.store.mutate(JOBS, child["metadata"]["namespace"], child["metadata"]["name"], resume)

    def _fail_or_restart(self, jobset: Obj, children: dict[str, Obj], restarts: int, now: str) -> None:
        max_restarts = int((jobset["spec"].get("failurePolicy") or {}).get("maxRestarts") or 0)
        if restarts < max_restarts:
            for child in children.values():
                if not child["metadata"].get("deletionTimestamp"):
                    self.store.delete(
                        JOBS, child["metadata"]["namespace"], child["metadata"]["name"], propagation="Background"
                    )
            write_status(self.store, JOBSETS, jobset, lambda s: s.__setitem__("restarts", restarts + 1))
            return
        reason, message = (
            ("ReachedMaxRestarts", "jobset failed due to reaching max number of restarts")
            if max_restarts
            else ("FailedJobs", "jobset failed due to one or more job failures")
        )

        def failed(s: Obj) -> None:
            set_status_condition(s, "Failed", "True", reason, message, now)
            s["terminalState"] = "Failed"

        write_status(self.store, JOBSETS, jobset, failed)

    def _write_status(self, jobset: Obj, suspend: bool, now: str) -> None:
        children = owned(self.store, JOBS, jobset)
        spec = jobset["spec"]
        rows = []
        for replicated in spec.get("replicatedJobs") or []:
            mine = [
                j for j in children if j["metadata"]["labels"].get(f"{PREFIX}/replicatedjob-name") == replicated["name"]
            ]
            parallelism = lambda j: int(j["spec"].get("parallelism", 1))  # noqa: E731
            rows.append(
                {
                    "name": replicated["name"],
                    "ready": sum(
                        1
                        for j in mine
                        if int((j.get("status") or {}).get("ready") or 0)
                        + int((j.get("status") or {}).get("succeeded") or 0)
                        >= parallelism(j)
                    ),
                    "succeeded": sum(1 for j in mine if condition_true(j, "Complete")),
                    "failed": sum(1 for j in mine if condition_true(j, "Failed")),
                    "active": sum(1 for j in mine if (j.get("status") or {}).get("active")),
                    "suspended": sum(1 for j in mine if j["spec"].get("suspend")),
                }
            )
        policy = spec.get("successPolicy") or {}
        targets = policy.get("targetReplicatedJobs") or [r["name"] for r in spec.get("replicatedJobs") or []]
        target_jobs = [j for j in children if j["metadata"]["labels"].get(f"{PREFIX}/replicatedjob-name") in targets]
        expected = sum(int(r.get("replicas", 1)) for r in spec.get("replicatedJobs") or [] if r["name"] in targets)
        complete = [j for j in target_jobs if condition_true(j, "Complete")]
        done = bool(complete) if policy.get("operator") == "Any" else len(complete) >= expected > 0

        def status(s: Obj) -> None:
            s["replicatedJobsStatus"] = rows
            was_suspended = condition_true({"status": s}, "Suspended")
            if suspend and not was_suspended:
                set_status_condition(s, "Suspended", "True", "SuspendedJobs", "jobset is suspended", now)
            elif not suspend and was_suspended:
                set_status_condition(s, "Suspended", "False", "ResumeJobs", "jobset is resumed", now)
            if done:
                set_status_condition(s, "Completed", "True", "AllJobsCompleted", "jobset completed successfully", now)
                s["terminalState"] = "Completed"

        write_status(self.store, JOBSETS, jobset, status)
