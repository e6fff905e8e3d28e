"""The kubelet of every fake node, and the node lifecycle controller's part that matters to gpuq.

`reconcile()` does what a kubelet does on its own: starts bound pods (Pending → Running and Ready, or an image
pull error for images a test declared unpullable) and finishes graceful deletions. What a container does is the
test's decision: `finish(...)` (exit code and reason, e.g. OOMKilled), `evict(...)`; `set_node_ready(...)` plays
a node going NotReady, with the taints and pod conditions the node lifecycle controller would set."""

from __future__ import annotations

import re
from typing import Any

from .clock import parse_time
from .resources import NODES, PODS
from .store import TERMINAL_POD_PHASES, Obj, Store, get_condition, set_condition

NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
TERMINATED_REASONS = {0: "Completed", 137: "OOMKilled"}


class FakeKubelet:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.unpullable_images: set[str] = set()
        self.start_pods = True  # reconcile() starts bound pods; a test can hold them Pending instead
        self.hold_terminations = False  # keep deleted pods Terminating until their grace period ends
        # node -> (reason, message): its kubelet rejects the pods bound to it at admission (phase Failed with that
        # reason), as a kubelet whose device plugin has fewer healthy GPUs than the node's allocatable does
        self.rejections: dict[str, tuple[str, str]] = {}
        self._ip = 0

    # --- what the kubelet does by itself -------------------------------------------------------------------------

    def reconcile(self) -> bool:
        before = self.store.resource_version
        ready_nodes = {n["metadata"]["name"] for n in self.store.list(NODES) if _ready(n)}
        expired = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in self.store.expired_deletions(PODS)}
        for pod in self.store.list(PODS):
            meta, node = pod["metadata"], pod["spec"].get("nodeName")
            key = (meta["namespace"], meta["name"])
            if not node:
                continue
            if meta.get("deletionTimestamp"):
                if not self.hold_terminations or key in expired or node not in ready_nodes:
                    self._terminate(pod)
                continue
            if node in ready_nodes and self.start_pods and pod["status"].get("phase") == "Pending":
                self.start(meta["namespace"], meta["name"])
            elif pod["status"].get("phase") == "Running":
                self._run_program(pod)
        self._evict_for_taints()
        return self.store.resource_version != before

    def start(self, namespace: str, name: str) -> None:
        """Pending → Running with all containers ready (or stuck on an image pull for an unpullable image, or
        Failed when the node's kubelet rejects its pods: `rejections`)."""
        pod = self.store.get(PODS, namespace, name)
        if not pod["spec"].get("nodeName") or pod["status"].get("phase") != "Pending":
            return
        now = self.store.clock.stamp()
        rejection = self.rejections.get(pod["spec"]["nodeName"])
        if rejection is not None:
            self.store.mutate(PODS, namespace, name, lambda p: _rejected(p, *rejection, now))
            return
        containers = pod["spec"].get("containers") or []
        bad = [c for c in containers if c.get("image") in self.unpullable_images]
        if bad:
            previous = {s["name"]: s for s in pod["status"].get("containerStatuses") or []}

            def waiting(p: Obj) -> None:
                statuses = []
                for c in containers:
                    if c in bad:
                        # The first failure is ErrImagePull, then the kubelet backs off: ImagePullBackOff.
                        was = ((previous.get(c["name"]) or {}).get("state") or {}).get("waiting") or {}
                        reason = (
                            "ImagePullBackOff"
                            if was.get("reason") in ("ErrImagePull", "ImagePullBackOff")
                            else "ErrImagePull"
                        )
                        message = (
                            f'Back-off pulling image "{c["image"]}"'
                            if reason == "ImagePullBackOff"
                            else f'failed to pull and unpack image "{c["image"]}": not found'
                        )
                        state: Obj = {"waiting": {"reason": reason, "message": message}}
                    else:
                        state = {"waiting": {"reason": "ContainerCreating"}}
                    statuses.append(_container_status(c, state, ready=False))
                p["status"]["containerStatuses"] = statuses
                p["status"].setdefault("startTime", now)
                set_condition(p, "Initialized", "True", None, None, now)
                set_condition(
                    p,
                    "ContainersReady",
                    "False",
                    "ContainersNotReady",
                    f"containers with unready status: [{' '.join(c['name'] for c in bad)}]",
                    now,
                )
                set_condition(
                    p,
                    "Ready",
                    "False",
                    "ContainersNotReady",
                    f"containers with unready status: [{' '.join(c['name'] for c in bad)}]",
                    now,
                )

            self.store.mutate(PODS, namespace, name, waiting)
            return
        self._ip += 1
        ip = f"10.244.{self._ip // 250}.{self._ip % 250 + 2}"

        def running(p: Obj) -> None:
            status = p["status"]
            status["phase"] = "Running"
            status["startTime"] = status.get("startTime") or now
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
            status["hostIP"] = "192.168.0.1"
            status["containerStatuses"] = [
                _container_status(c, {"running": {"startedAt": now}}, ready=True) for c in containers
            ]
            for kind in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready"):
                set_condition(p, kind, "True", None, None, now)

        self.store.mutate(PODS, namespace, name, running)

    def _run_program(self, pod: Obj) -> None:
        """A pod whose containers all run a trivial shell program (`sleep N`, `exit N`, `true`, `false`) ends as it
        would on a real node: once N seconds of the fake clock have passed since it started, with that exit code.
        Any other program runs until the test says how it ends."""
        programs = [container_program(c) for c in pod["spec"].get("containers") or []]
        started = pod["status"].get("startTime")
        if not programs or any(p is None for p in programs) or not started:
            return
        duration = max(p[0] for p in programs if p is not None)
        if self.store.clock.seconds_since(started) < duration:
            return
        code = next((p[1] for p in programs if p is not None and p[1] != 0), 0)
        meta = pod["metadata"]
        self.finish(meta["namespace"], meta["name"], exit_code=code)

    def _terminate(self, pod: Obj) -> None:
        """Containers got SIGTERM and stopped (exit 143), then the final delete."""
        meta = pod["metadata"]
        if pod["status"].get("phase") not in TERMINAL_POD_PHASES:
            self.finish(
                meta["namespace"],
                meta["name"],
                exit_code=143,
                reason="Error",
                message="terminated by SIGTERM on deletion",
            )
        self.store.finish_deletion(PODS, meta["namespace"], meta["name"])

    # --- what a test makes happen --------------------------------------------------------------------------------

    def finish(
        self, namespace: str, name: str, *, exit_code: int = 0, reason: str | None = None, message: str | None = None
    ) -> None:
        """The pod's containers exit with `exit_code` (reason: Completed for 0, OOMKilled for 137, else Error
        unless given). With restartPolicy Never the pod ends Succeeded/Failed; with OnFailure a failed container
        restarts in place (restartCount, lastState), as the kubelet does."""
        pod = self.store.get(PODS, namespace, name)
        if pod["status"].get("phase") in TERMINAL_POD_PHASES:
            return
        now = self.store.clock.stamp()
        reason = reason or TERMINATED_REASONS.get(exit_code, "Error")
        containers = pod["spec"].get("containers") or []
        restart = pod["spec"].get("restartPolicy", "Always")
        restarts_in_place = (
            exit_code != 0 and restart in ("OnFailure", "Always") and not pod["metadata"].get("deletionTimestamp")
        )
        started = pod["status"].get("startTime") or now

        def terminated(p: Obj) -> None:
            terminated_state: Obj = {"exitCode": exit_code, "reason": reason, "startedAt": started, "finishedAt": now}
            if message:
                terminated_state["message"] = message
            statuses = []
            for c in containers:
                old = next((s for s in p["status"].get("containerStatuses") or [] if s.get("name") == c["name"]), None)
                count = int((old or {}).get("restartCount") or 0)
                if restarts_in_place:
                    status = _container_status(c, {"running": {"startedAt": now}}, ready=True, restarts=count + 1)
                    status["lastState"] = {"terminated": terminated_state}
                else:
                    status = _container_status(c, {"terminated": terminated_state}, ready=False, restarts=count)
                statuses.append(status)
            p["status"]["containerStatuses"] = statuses
            if restarts_in_place:
                return
            p["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
            p["status"].setdefault("startTime", started)
            for kind in ("ContainersReady", "Ready"):
                set_condition(p, kind, "False", "PodCompleted", None, now)

        self.store.mutate(PODS, namespace, name, terminated)

    def oom_kill(self, namespace: str, name: str) -> None:
        self.finish(namespace, name, exit_code=137, reason="OOMKilled")

    def evict(self, namespace: str, name: str, message: str = "The node was low on resource: memory.") -> None:
        """Node-pressure eviction: the pod fails with reason Evicted and a DisruptionTarget condition."""
        now = self.store.clock.stamp()

        def evicted(p: Obj) -> None:
            p["status"]["phase"] = "Failed"
            p["status"]["reason"] = "Evicted"
            p["status"]["message"] = message
            set_condition(p, "DisruptionTarget", "True", "TerminationByKubelet", message, now)
            for kind in ("ContainersReady", "Ready"):
                set_condition(p, kind, "False", "PodFailed", None, now)

        self.store.mutate(PODS, namespace, name, evicted)

    def set_node_ready(self, name: str, ready: bool) -> None:
        """Ready/NotReady as the kubelet reports it, plus what the node lifecycle controller does: the not-ready
        NoSchedule/NoExecute taints, and Ready=False on the node's pods."""
        now = self.store.clock.stamp()

        def node_state(n: Obj) -> None:
            if ready:
                set_condition(n, "Ready", "True", "KubeletReady", "kubelet is posting ready status", now)
            else:
                set_condition(n, "Ready", "False", "KubeletNotReady", "container runtime is down", now)
            taints = [t for t in (n.setdefault("spec", {}).get("taints") or []) if t.get("key") != NOT_READY_TAINT]
            if not ready:
                taints += [
                    {"key": NOT_READY_TAINT, "effect": "NoSchedule", "timeAdded": now},
                    {"key": NOT_READY_TAINT, "effect": "NoExecute", "timeAdded": now},
                ]
            n["spec"]["taints"] = taints
            if not taints:
                n["spec"].pop("taints")

        self.store.mutate(NODES, None, name, node_state)
        if not ready:
            for pod in self.store.list(PODS, None, lambda p: p["spec"].get("nodeName") == name):
                if pod["status"].get("phase") in TERMINAL_POD_PHASES:
                    continue
                meta = pod["metadata"]
                self.store.mutate(
                    PODS,
                    meta["namespace"],
                    meta["name"],
                    lambda p: set_condition(p, "Ready", "False", "NodeNotReady", None, now),
                )

    def _evict_for_taints(self) -> None:
        """Taint-based eviction: a pod on a node with a NoExecute taint it does not tolerate (or tolerates for
        tolerationSeconds that have passed since the taint was added) is deleted."""
        now = self.store.clock.now()
        nodes = {n["metadata"]["name"]: n for n in self.store.list(NODES)}
        for pod in self.store.list(PODS):
            node = nodes.get(pod["spec"].get("nodeName") or "")
            if (
                node is None
                or pod["metadata"].get("deletionTimestamp")
                or pod["status"].get("phase") in TERMINAL_POD_PHASES
            ):
                continue
            for taint in (node.get("spec") or {}).get("taints") or []:
                if taint.get("effect") != "NoExecute":
                    continue
                seconds = _tolerated_for(pod["spec"].get("tolerations") or [], taint)
                added = parse_time(taint["timeAdded"]) if taint.get("timeAdded") else now
                if seconds is not None and (seconds == float("inf") or (now - added).total_seconds() < seconds):
                    continue
                meta = pod["metadata"]
                self.store.delete(PODS, meta["namespace"], meta["name"])
                break


_SHELLS = ("sh", "/bin/sh", "bash", "/bin/bash")


def container_program(container: Obj) -> tuple[float, int] | None:
    """(seconds it runs, exit code) of a trivial program, or None when the fake cannot tell."""
    words = [str(w) for w in [*(container.get("command") or []), *(container.get("args") or [])]]
    if len(words) >= 3 and words[0] in _SHELLS and words[1] == "-c":
        script = " ".join(words[2:])
    elif words and words[0] in ("sleep", "/bin/sleep", "true", "/bin/true", "false", "/bin/false"):
        script = " ".join(words)
    else:
        return None
    seconds, code = 0.0, 0
    for statement in re.split(r"\s*(?:;|&&|\n)\s*", script.strip()):
        parts = statement.split()
        if not parts:
            continue
        if parts[0] in ("sleep", "/bin/sleep") and len(parts) == 2 and re.fullmatch(r"\d+(\.\d+)?s?", parts[1]):
            seconds += float(parts[1].rstrip("s"))
        elif parts[0] == "exit" and len(parts) <= 2 and (len(parts) == 1 or parts[1].isdigit()):
            return seconds, int(parts[1]) if len(parts) == 2 else 0
        elif parts[0] in ("true", "/bin/true") and len(parts) == 1:
            code = 0
        elif parts[0] in ("false", "/bin/false") and len(parts) == 1:
            code = 1
        else:
            return None
    return seconds, code


def _tolerated_for(tolerations: list[Obj], taint: Obj) -> float | None:
    """How long the pod tolerates the taint: None (not at all), a number of seconds, or infinity."""
    from .scheduler import tolerates

    best: float | None = None
    for toleration in tolerations:
        if tolerates([toleration], taint):
            seconds = toleration.get("tolerationSeconds")
            value = float("inf") if seconds is None else float(seconds)
            best = value if best is None else max(best, value)
    return best


def _rejected(pod: Obj, reason: str, message: str, now: str) -> None:
    """What a kubelet's admission handlers leave on a pod they reject: Failed, the reason, no container started."""
    status = pod["status"]
    status["phase"] = "Failed"
    status["reason"] = reason
    status["message"] = f"Pod was rejected: {message}"
    status["startTime"] = status.get("startTime") or now


def _ready(node: Obj) -> bool:
    condition = get_condition(node, "Ready")
    return condition is not None and condition.get("status") == "True"


def _container_status(container: Obj, state: Obj, *, ready: bool, restarts: int = 0) -> dict[str, Any]:
    return {
        "name": container["name"],
        "image": container.get("image", ""),
        "imageID": "",
        "ready": ready,
        "started": "running" in state,
        "restartCount": restarts,
        "state": state,
    }
