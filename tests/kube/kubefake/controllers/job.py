"""The batch/v1 Job controller, as far as gpuq's executor can observe it.

- Pods from the template as it is when they are created, named `<job>-<random>` (NonIndexed) or
  `<job>-<index>-<random>` (Indexed, with the `batch.kubernetes.io/job-completion-index` annotation and label and
  JOB_COMPLETION_INDEX env), labelled `batch.kubernetes.io/job-name` and `batch.kubernetes.io/controller-uid`,
  owned by the Job, with the `batch.kubernetes.io/job-tracking` finalizer until counted.
- suspend: a suspended Job has no pods (active pods are deleted, not counted as failures), condition Suspended
  (reason JobSuspended), startTime cleared; unsuspending creates pods from the template at that moment and sets
  Suspended=False (JobResumed).
- Complete (succeeded reaches completions; every index for Indexed) with SuccessCriteriaMet; Failed with
  BackoffLimitExceeded (failed pods, or container restarts under OnFailure, beyond backoffLimit) or
  DeadlineExceeded (activeDeadlineSeconds since startTime), with FailureTarget; active pods are then deleted. As
  the real controller requeues a Job to sync again when its deadline runs out, `next_deadline()` says when that
  is, and the fake cluster settles again then (under autopilot).
- Not emulated: the pod-creation backoff delay (failed pods are replaced at once), podFailurePolicy,
  successPolicy, backoffLimitPerIndex, elastic parallelism, podReplacementPolicy Failed.
"""

from __future__ import annotations

from ..resources import JOBS, PODS
from ..selectors import label_selector_object_match
from ..store import Obj
from .common import (
    WorkloadController,
    condition_true,
    create_from_template,
    delete_pods,
    env_var,
    is_active,
    is_ready,
    owned,
    set_status_condition,
    write_status,
)

TRACKING_FINALIZER = "batch.kubernetes.io/job-tracking"
INDEX_KEY = "batch.kubernetes.io/job-completion-index"


def format_indexes(indexes: set[int]) -> str:
    """`0-2,4` as in status.completedIndexes."""
    parts, ordered, i = [], sorted(indexes), 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_indexes(text: str | None) -> set[int]:
    indexes: set[int] = set()
    for part in (text or "").split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        indexes.update(range(int(low), int(high or low) + 1))
    return indexes


class JobController(WorkloadController):
    resource = JOBS

    def sync_all(self) -> None:
        super().sync_all()
        self._release_orphans()

    def next_deadline(self) -> float | None:
        """Seconds until the first running Job reaches its activeDeadlineSeconds (None: no Job has one pending):
        the real controller syncs such a Job again then (`AddAfter(key, activeDeadlineSeconds - elapsed)`)."""
        waits = []
        for job in self.store.list(JOBS):
            spec, status = job["spec"], job.get("status") or {}
            deadline, started = spec.get("activeDeadlineSeconds"), status.get("startTime")
            if deadline is None or not started or spec.get("suspend") or job["metadata"].get("deletionTimestamp"):
                continue
            if condition_true(job, "Complete") or condition_true(job, "Failed"):
                continue
            waits.append(int(deadline) - self.store.clock.seconds_since(started))
        return max(0.0, min(waits)) if waits else None

    def _release_orphans(self) -> None:
        """Pods whose Job is gone (or that were orphaned) lose the tracking finalizer, as the real controller does."""
        jobs = {job["metadata"]["uid"] for job in self.store.list(JOBS)}
        for pod in self.store.list(PODS, None, lambda p: TRACKING_FINALIZER in (p["metadata"].get("finalizers") or [])):
            owners = [r.get("uid") for r in pod["metadata"].get("ownerReferences") or [] if r.get("kind") == "Job"]
            if not any(uid in jobs for uid in owners):
                self._release(pod)

    def _release(self, pod: Obj) -> None:
        meta = pod["metadata"]
        self.store.mutate(
            PODS,
            meta["namespace"],
            meta["name"],
            lambda p: p["metadata"].__setitem__(
                "finalizers", [f for f in p["metadata"].get("finalizers") or [] if f != TRACKING_FINALIZER]
            ),
        )

    def _pods(self, job: Obj) -> list[Obj]:
        selector = job["spec"].get("selector")
        return [
            p
            for p in owned(self.store, PODS, job)
            if label_selector_object_match(selector, p["metadata"].get("labels"))
        ]

    def sync(self, job: Obj) -> None:
        spec, now = job["spec"], self.store.clock.stamp()
        finished = condition_true(job, "Complete") or condition_true(job, "Failed")
        pods = self._pods(job)
        self._count_finished(job, pods, counting=not finished and not spec.get("suspend"))
        job = self.store.get(JOBS, job["metadata"]["namespace"], job["metadata"]["name"])
        status = job.get("status") or {}
        pods = self._pods(job)
        active = [p for p in pods if is_active(p)]
        if finished:
            delete_pods(self.store, active)
            self._write_counts(job, self._pods(job))
            return
        indexed = spec.get("completionMode") == "Indexed"
        completions = int(spec.get("completions") or 1)
        succeeded = int(status.get("succeeded") or 0)
        completed = parse_indexes(status.get("completedIndexes"))
        if (indexed and len(completed) >= completions) or (not indexed and succeeded >= completions):
            delete_pods(self.store, active)
            self._finish(job, "Complete", None, None)
            return
        failures = int(status.get("failed") or 0)
        if spec.get("template", {}).get("spec", {}).get("restartPolicy") == "OnFailure":
            failures += sum(
                int(s.get("restartCount") or 0) for p in active for s in p["status"].get("containerStatuses") or []
            )
        if failures > int(spec.get("backoffLimit", 6)):
            delete_pods(self.store, active)
            self._finish(job, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
            return
        deadline = spec.get("activeDeadlineSeconds")
        started = status.get("startTime")
        overdue = deadline is not None and started and self.store.clock.seconds_since(started) >= int(deadline)
        if overdue and not spec.get("suspend"):
            delete_pods(self.store, active)
            self._finish(job, "Failed", "DeadlineExceeded", "Job was active longer than specified deadline")
            return
        if spec.get("suspend"):
            delete_pods(self.store, active)

            def suspended(s: Obj) -> None:
                if not condition_true({"status": s}, "Suspended"):
                    set_status_condition(s, "Suspended", "True", "JobSuspended", "Job suspended", now)
                s.pop("startTime", None)

            write_status(self.store, JOBS, job, suspended)
        else:

            def resumed(s: Obj) -> None:
                if condition_true({"status": s}, "Suspended"):
                    set_status_condition(s, "Suspended", "False", "JobResumed", "Job resumed", now)
                s.setdefault("startTime", now)

            write_status(self.store, JOBS, job, resumed)
            job = self.store.get(JOBS, job["metadata"]["namespace"], job["metadata"]["name"])
            self._create_missing(job, active, completed if indexed else None, completions - succeeded)
        self._write_counts(self.store.get(JOBS, job["metadata"]["namespace"], job["metadata"]["name"]), self._pods(job))

    def _count_finished(self, job: Obj, pods: list[Obj], counting: bool) -> None:
        """Count each finished pod once (into succeeded/failed/completedIndexes) and release its tracking
        finalizer. Pods the controller deleted itself (suspend, job finished) are released uncounted."""
        for pod in pods:
            meta = pod["metadata"]
            if TRACKING_FINALIZER not in (meta.get("finalizers") or []):
                continue
            phase = pod["status"].get("phase")
            if phase not in ("Succeeded", "Failed") and (
                not meta.get("deletionTimestamp") or pod["spec"].get("nodeName")
            ):
                continue  # running, or terminating on a node whose kubelet has not stopped it yet
            if phase in ("Succeeded", "Failed") and counting:
                index = (meta.get("annotations") or {}).get(INDEX_KEY)

                def count(s: Obj, phase: str = phase, index: str | None = index) -> None:
                    if phase == "Succeeded":
                        s["succeeded"] = int(s.get("succeeded") or 0) + 1
                        if index is not None:
                            s["completedIndexes"] = format_indexes(
                                parse_indexes(s.get("completedIndexes")) | {int(index)}
                            )
                    else:
                        s["failed"] = int(s.get("failed") or 0) + 1

                write_status(self.store, JOBS, job, count)
            self._release(pod)

    def _create_missing(self, job: Obj, active: list[Obj], completed: set[int] | None, remaining: int) -> None:
        spec = job["spec"]
        parallelism = int(spec.get("parallelism", 1))
        name = job["metadata"]["name"]
        if completed is None:
            for _ in range(max(0, min(parallelism, remaining) - len(active))):
                create_from_template(
                    self.store, PODS, job, spec["template"], generate_name=f"{name}-", finalizers=[TRACKING_FINALIZER]
                )
            return
        running = {int((p["metadata"].get("annotations") or {}).get(INDEX_KEY, -1)) for p in active}
        wanted = [i for i in range(int(spec.get("completions") or 1)) if i not in completed and i not in running]
        for index in wanted[: max(0, parallelism - len(active))]:

            def with_index(pod_spec: Obj, index: int = index) -> None:
                for container in pod_spec.get("containers") or []:
                    env_var(container, "JOB_COMPLETION_INDEX", field_path=f"metadata.annotations['{INDEX_KEY}']")
                if pod_spec.get("subdomain"):
                    pod_spec.setdefault("hostname", f"{name}-{index}")

            create_from_template(
                self.store,
                PODS,
                job,
                spec["template"],
                generate_name=f"{name}-{index}-",
                labels={INDEX_KEY: str(index)},
                annotations={INDEX_KEY: str(index)},
                finalizers=[TRACKING_FINALIZER],
                mutate_spec=with_index,
            )

    def _write_counts(self, job: Obj, pods: list[Obj]) -> None:
        active = [p for p in pods if is_active(p)]
        terminating = [
            p
            for p in pods
            if p["metadata"].get("deletionTimestamp") and p["status"].get("phase") not in ("Succeeded", "Failed")
        ]

        def counts(s: Obj) -> None:
            s["active"] = len(active)
            s["ready"] = sum(1 for p in active if is_ready(p))
            s["terminating"] = len(terminating)
            for key in ("active", "terminating"):
                if not s[key]:
                    del s[key]

        write_status(self.store, JOBS, job, counts)

    def _finish(self, job: Obj, kind: str, reason: str | None, message: str | None) -> None:
        now = self.store.clock.stamp()

        def finished(s: Obj) -> None:
            if kind == "Complete":
                set_status_condition(
                    s,
                    "SuccessCriteriaMet",
                    "True",
                    "CompletionsReached",
                    "Reached expected number of succeeded pods",
                    now,
                )
                set_status_condition(
                    s, "Complete", "True", "CompletionsReached", "Reached expected number of succeeded pods", now
                )
                s["completionTime"] = now
            else:
                set_status_condition(s, "FailureTarget", "True", reason, message, now)
                set_status_condition(s, "Failed", "True", reason, message, now)

        write_status(self.store, JOBS, job, finished)
