"""What a test holds: a cluster it reaches through real clients, fake or real, with helpers that work on both.

On the fake, the helpers drive the test-side actors (scheduler, kubelet, controllers) deterministically; on a real
cluster (GPUQ_KUBECONFIG) the real ones act and the same helpers wait for what they do. Helpers that only a fake can
do (add a node, OOM-kill a pod, advance the clock) are on `cluster.fake`, which skips the test on a real cluster."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ServiceAccount

from .auth import ADMIN_USER
from .controllers import RayJobController, all_controllers
from .kinds import LIGHTKUBE_KINDS
from .kubelet import FakeKubelet
from .resources import DEVICE_CLASSES, NAMESPACES, NODES, PODS, RESOURCE_SLICES, ResourceType
from .scheduler import FakeScheduler
from .selectors import make_matcher, parse_label_selector
from .server import FakeKubeServer, KubeAccess
from .store import Change, Obj, Store, get_condition

Predicate = Callable[[Obj], bool]


class NotSettled(AssertionError):
    """A wait timed out; the message says what the cluster looked like."""


class KubeCluster:
    """The common face of the fake and of a real cluster."""

    is_fake: bool = False

    def __init__(self, access: KubeAccess) -> None:
        self.access = access
        self._client: AsyncClient | None = None
        self._namespaces: list[str] = []

    # --- access --------------------------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.access.kubeconfig

    @property
    def server(self) -> str:
        return self.access.server

    @property
    def token(self) -> str | None:
        return self.access.token

    def client(self) -> AsyncClient:
        """A lightkube client for the test's own reads and writes (closed with the fixture)."""
        if self._client is None:
            self._client = AsyncClient(KubeConfig.from_file(self.kubeconfig))
        return self._client

    @property
    def fake(self) -> FakeCluster:
        pytest.skip("this test drives the fake cluster's actors; it cannot run against a real cluster")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    # --- the same on both ----------------------------------------------------------------------------------------

    async def settle(self) -> None:
        """Fake: run the actors until nothing changes. Real: nothing to do (the real ones run on their own)."""

    async def ensure_worker_node(self) -> None:
        """Fake: add a plain worker node when the cluster has none (a fresh fake has no nodes). Real: nothing to do."""

    async def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
        await self.client().create(LIGHTKUBE_KINDS[NAMESPACES].from_dict(body))
        self._namespaces.append(name)
        return name

    async def username(self) -> str:
        """Who the kubeconfig's credentials are (SelfSubjectReview, `kubectl auth whoami`)."""
        from lightkube.resources.authentication_v1 import SelfSubjectReview

        review = await self.client().create(SelfSubjectReview.from_dict(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}))
        return str(review.status.userInfo.username)

    async def create_service_account(self, namespace: str, name: str) -> None:
        await self.client().create(ServiceAccount.from_dict(
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}}))

    async def service_account_token(self, namespace: str, name: str, audiences: tuple[str, ...] = (),
                                    expiration_s: int = 3600) -> str:
        """A token of the ServiceAccount from the TokenRequest API (`kubectl create token`), for `audiences` (the
        API server's own when empty)."""
        request = ServiceAccount.Token(metadata=ObjectMeta(name=name, namespace=namespace),
                                       spec=TokenRequestSpec(audiences=list(audiences), expirationSeconds=expiration_s))
        issued = await self.client().create(request, name, namespace=namespace)
        assert issued.status is not None
        return str(issued.status.token)

    def token_kubeconfig(self, token: str, path: Path) -> Path:
        """This cluster's kubeconfig, with the current context's user replaced by `token` (another identity)."""
        config = yaml.safe_load(self.kubeconfig.read_text())
        context = next(c for c in config["contexts"] if c["name"] == config["current-context"])["context"]
        config["users"] = [{"name": context["user"], "user": {"token": token}}]
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    async def read(self, resource: ResourceType, name: str, namespace: str | None = None) -> Obj | None:
        try:
            obj = await self.client().get(LIGHTKUBE_KINDS[resource], name, namespace=namespace)
        except ApiError as error:
            if error.status.code == 404:
                return None
            raise
        return _as_dict(obj)

    async def list(self, resource: ResourceType, namespace: str | None = None, labels: str | None = None) -> list[Obj]:
        matcher = make_matcher(parse_label_selector(labels), [])
        kind = LIGHTKUBE_KINDS[resource]
        kwargs: dict[str, Any] = {"namespace": namespace} if resource.namespaced and namespace else {}
        if resource.namespaced and not namespace:
            kwargs["namespace"] = "*"
        items = [_as_dict(obj) async for obj in self.client().list(kind, **kwargs)]
        return [item for item in items if matcher(item)]

    async def wait_for(
        self,
        what: str,
        check: Callable[[], Awaitable[Any]],
        timeout_s: float = 30,
    ) -> Any:
        """Poll `check` (settling the fake first) until it returns something truthy."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.settle()
            result = await check()
            if result:
                return result
            if time.monotonic() > deadline:
                raise NotSettled(f"timed out after {timeout_s}s waiting for {what}")
            await asyncio.sleep(self._poll_s)

    _poll_s = 0.5

    async def wait_for_object(
        self, resource: ResourceType, name: str, namespace: str | None, predicate: Predicate, timeout_s: float = 30
    ) -> Obj:
        async def check() -> Obj | None:
            obj = await self.read(resource, name, namespace)
            return obj if obj is not None and predicate(obj) else None

        result: Obj = await self.wait_for(
            f"{resource} {namespace}/{name} to satisfy {predicate.__name__}", check, timeout_s
        )
        return result

    async def pods(self, namespace: str, labels: str | None = None) -> list[Obj]:
        return await self.list(PODS, namespace, labels)

    async def run_pods_to_ready(
        self, namespace: str, labels: str | None = None, count: int | None = None, timeout_s: float = 60
    ) -> list[Obj]:
        """Wait until `count` (default: all unfinished ones, at least one) matching pods are Running and Ready.
        The fake's kubelet starts them; a pod that cannot be scheduled fails the wait with its PodScheduled message."""

        async def check() -> list[Obj] | None:
            pods = [
                p
                for p in await self.pods(namespace, labels)
                if not p["metadata"].get("deletionTimestamp")
                and p["status"].get("phase") not in ("Succeeded", "Failed")
            ]
            ready = [p for p in pods if _pod_ready(p)]
            wanted = count if count is not None else max(1, len(pods))
            return ready if len(ready) >= wanted else None

        try:
            result: list[Obj] = await self.wait_for(f"pods {namespace} {labels or ''} to be ready", check, timeout_s)
        except NotSettled as error:
            raise NotSettled(f"{error}; pods: {await self._describe_pods(namespace, labels)}") from None
        return result

    async def complete_pods(
        self,
        namespace: str,
        labels: str | None = None,
        *,
        exit_code: int = 0,
        reason: str | None = None,
        timeout_s: float = 120,
    ) -> list[Obj]:
        """The matching running pods finish. Fake: the kubelet ends them with `exit_code` (and `reason`). Real: the
        pods' own commands must end; this waits for it."""

        return await self._wait_finished(namespace, labels, {}, timeout_s)

    async def _wait_finished(
        self, namespace: str, labels: str | None, seen: dict[str, Obj], timeout_s: float
    ) -> list[Obj]:
        async def check() -> list[Obj] | None:
            # A finished pod may be deleted right away (a controller's cleanup): gone counts as finished.
            pods = await self.pods(namespace, labels)
            seen.update((p["metadata"]["name"], p) for p in pods)
            running = [p for p in pods if p["status"].get("phase") not in ("Succeeded", "Failed")]
            return list(seen.values()) if seen and not running else None

        result: list[Obj] = await self.wait_for(f"pods {namespace} {labels or ''} to finish", check, timeout_s)
        return result

    async def _describe_pods(self, namespace: str, labels: str | None) -> str:
        lines = []
        for pod in await self.pods(namespace, labels):
            scheduled = get_condition(pod, "PodScheduled") or {}
            lines.append(
                f"{pod['metadata']['name']} phase={pod['status'].get('phase')} node={pod['spec'].get('nodeName')} "
                f"gates={[g.get('name') for g in pod['spec'].get('schedulingGates') or []]} "
                f"scheduled={scheduled.get('status')}:{scheduled.get('reason')}:{scheduled.get('message')}"
            )
        return "; ".join(lines) or "none"

    @contextlib.asynccontextmanager
    async def autopilot(self) -> AsyncIterator[None]:
        """Fake: the actors react to every change by themselves while the block runs. Real: nothing to do."""
        yield

    async def cleanup(self) -> None:
        """Delete what this test created (its namespaces) on a real cluster; the fake just goes away."""


class FakeCluster(KubeCluster):
    """The fake API server with its actors. `settle()` runs the controllers, scheduler and kubelet until nothing
    changes; under `autopilot()` that happens after every change, as a real cluster would."""

    is_fake = True

    def __init__(self, server: FakeKubeServer) -> None:
        assert server.access is not None
        super().__init__(server.access)
        self.http = server
        self.store: Store = server.store
        self.clock = self.store.clock
        self.scheduler = FakeScheduler(self.store)
        self.kubelet = FakeKubelet(self.store)
        self.controllers = all_controllers(self.store)
        self.rayjobs = next(c for c in self.controllers if isinstance(c, RayJobController))
        self._poll_s = 0.05
        self._autopilot = 0
        self._settling = False
        self._pending: asyncio.Handle | None = None
        self._deadline: asyncio.TimerHandle | None = None  # the next Job deadline's sync (JobController)
        self._unsubscribe = self.store.subscribe(self._on_change)

    async def username(self) -> str:
        return ADMIN_USER  # the fake's kubeconfig token (it serves no SelfSubjectReview)

    @property
    def fake(self) -> FakeCluster:
        return self

    def settle_now(self, max_rounds: int = 100) -> int:
        """Run every actor until a whole round changes nothing; returns the number of rounds."""
        self._settling = True
        try:
            for rounds in range(1, max_rounds + 1):
                changed = False
                for actor in (*self.controllers, self.scheduler, self.kubelet):
                    changed = actor.reconcile() or changed
                if not changed:
                    return rounds
        finally:
            self._settling = False
        raise RuntimeError(f"the fake cluster did not settle in {max_rounds} rounds: an actor keeps changing objects")

    async def settle(self) -> None:
        self.settle_now()

    async def ensure_worker_node(self) -> None:
        if not self.store.list(NODES):
            self.add_node("kubefake-worker", cpu="8", memory="32Gi")

    async def wait_for(self, what: str, check: Callable[[], Awaitable[Any]], timeout_s: float = 30) -> Any:
        # On the fake only the fake clock's programs (sleep N) take time; a long wait means a stuck test.
        return await super().wait_for(what, check, min(timeout_s, self.max_wait_s))

    max_wait_s = 15.0

    def advance(self, seconds: float) -> None:
        """Move the fake clock (deadlines, grace periods, toleration seconds) and let the actors react."""
        self.clock.advance(seconds)
        self.settle_now()

    def _on_change(self, change: Change) -> None:
        if not self._autopilot or self._settling or self._pending is not None:
            return
        self._pending = asyncio.get_running_loop().call_soon(self._auto_settle)

    def _auto_settle(self) -> None:
        self._pending = None
        if self._autopilot:
            self.settle_now()
            self._wake_at_next_deadline()

    def _wake_at_next_deadline(self) -> None:
        """Settle again when the first Job's activeDeadlineSeconds runs out, as the real Job controller syncs it
        then: nothing else would make the fake look at it (its clock is the wall clock, second-precise)."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        waits = [w for c in self.controllers if (w := getattr(c, "next_deadline", lambda: None)()) is not None]
        if waits and self._autopilot:
            self._deadline = asyncio.get_running_loop().call_later(min(waits) + 0.05, self._auto_settle)

    @contextlib.asynccontextmanager
    async def autopilot(self) -> AsyncIterator[None]:
        self._autopilot += 1
        self.settle_now()
        self._wake_at_next_deadline()
        try:
            yield
        finally:
            self._autopilot -= 1
            if not self._autopilot and self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

    def add_node(
        self,
        name: str,
        *,
        gpus: int = 0,
        gpu_product: str | None = None,
        gpu_memory_mib: int | None = None,
        mig: dict[str, int] | None = None,
        sharing: str | None = None,
        replicas: int = 0,
        renamed: bool = False,
        labels: dict[str, str] | None = None,
        taints: list[Obj] | None = None,
        cpu: str = "128",
        memory: str = "1Ti",
        pods: int = 110,
        ready: bool = True,
        unschedulable: bool = False,
    ) -> Obj:
        """A node as a GPU node looks with the NVIDIA device plugin and GPU Feature Discovery: allocatable
        nvidia.com/gpu (and nvidia.com/mig-<profile> for the mixed MIG strategy), nvidia.com/gpu.product,
        nvidia.com/gpu.count, nvidia.com/gpu.memory labels, plus kubernetes.io/hostname.

        `sharing` ("time-slicing" or "mps") with `replicas`: the device plugin's sharing config, as GFD labels it
        (nvidia.com/gpu.replicas, nvidia.com/gpu.sharing-strategy, nvidia.com/mps.capable, the product suffixed
        -SHARED unless renamed); each GPU is advertised `replicas` times as nvidia.com/gpu, or as
        nvidia.com/gpu.shared when `renamed`. `mig` beside `gpus`: the mixed strategy (nvidia.com/mig.strategy=mixed,
        `gpus` whole GPUs advertised beside the slices). Only the advertising is emulated: no device plugin hands
        out devices, no MPS daemon limits anything."""
        node_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
        if gpus or mig:
            node_labels["nvidia.com/gpu.present"] = "true"
            node_labels["nvidia.com/gpu.count"] = str(gpus)
        if gpu_product:
            shared_product = sharing is not None and not renamed
            node_labels["nvidia.com/gpu.product"] = gpu_product + ("-SHARED" if shared_product else "")
        if gpu_memory_mib:
            node_labels["nvidia.com/gpu.memory"] = str(gpu_memory_mib)
        if sharing is not None:
            assert sharing in ("time-slicing", "mps") and replicas >= 2, "sharing needs a mode and replicas >= 2"
            node_labels["nvidia.com/gpu.replicas"] = str(replicas)
            node_labels["nvidia.com/gpu.sharing-strategy"] = sharing
            node_labels["nvidia.com/mps.capable"] = "true" if sharing == "mps" else "false"
        if mig:
            node_labels["nvidia.com/mig.strategy"] = "mixed"
        node_labels.update(labels or {})
        resources = {"cpu": cpu, "memory": memory, "pods": str(pods), "ephemeral-storage": "1Ti"}
        if gpus and sharing is not None:
            resources["nvidia.com/gpu.shared" if renamed else "nvidia.com/gpu"] = str(gpus * replicas)
        elif gpus:
            resources["nvidia.com/gpu"] = str(gpus)
        for profile, count in sorted((mig or {}).items()):
            resources[f"nvidia.com/mig-{profile}"] = str(count)
        now = self.clock.stamp()
        spec: Obj = {}
        if taints:
            spec["taints"] = taints
        if unschedulable:
            spec["unschedulable"] = True
        node = {
            "metadata": {"name": name, "labels": node_labels},
            "spec": spec,
            "status": {
                "capacity": dict(resources),
                "allocatable": dict(resources),
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True" if ready else "False",
                        "reason": "KubeletReady",
                        "lastTransitionTime": now,
                        "lastHeartbeatTime": now,
                    }
                ],
                "addresses": [{"type": "Hostname", "address": name}],
                "nodeInfo": {
                    "kubeletVersion": "v1.31.0",
                    "containerRuntimeVersion": "containerd://1.7.0",
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                },
            },
        }
        created = self.store.create(NODES, None, node)
        if not ready:
            self.kubelet.set_node_ready(name, False)
        return self.store.get(NODES, None, created["metadata"]["name"])

    def add_gpu_slice(
        self, node: str, *, gpus: int, product: str = "NVIDIA H100 80GB HBM3", memory: str = "80Gi",
        driver: str = "gpu.nvidia.com", migs: dict[str, int] | None = None
    ) -> Obj:
        """The ResourceSlice NVIDIA's DRA driver (k8s-dra-driver-gpu) publishes for a node: one pool named after the
        node, devices gpu-<minor> of type gpu with productName, uuid and index attributes and their memory capacity,
        and MIG devices (type mig, with a profile) when `migs` (profile -> count) is given. Also the DeviceClass
        `gpu.nvidia.com` its chart installs. Nothing allocates them but their claims' writers (see scheduler.py)."""
        if self.store.find(DEVICE_CLASSES, None, "gpu.nvidia.com") is None:
            self.store.create(DEVICE_CLASSES, None, {"metadata": {"name": "gpu.nvidia.com"}, "spec": {"selectors": [
                {"cel": {"expression": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com']"
                                       ".type == 'gpu'"}}]}})
        devices: list[Obj] = [{"name": f"gpu-{i}", "attributes": {
            "type": {"string": "gpu"}, "uuid": {"string": f"GPU-{node}-{i}"}, "productName": {"string": product},
            "index": {"int": i}, "architecture": {"string": "Hopper"}, "cudaComputeCapability": {"version": "9.0.0"}},
            "capacity": {"memory": {"value": memory}}} for i in range(gpus)]
        for profile, count in sorted((migs or {}).items()):
            devices += [{"name": f"gpu-{gpus}-mig-{profile.replace('.', '')}-{j}", "attributes": {
                "type": {"string": "mig"}, "profile": {"string": profile}, "productName": {"string": product}}}
                for j in range(count)]
        body = {"metadata": {"name": f"{node}-{driver}"}, "spec": {
            "driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices}}
        return self.store.create(RESOURCE_SLICES, None, body)

    async def run_pods_to_ready(
        self, namespace: str, labels: str | None = None, count: int | None = None, timeout_s: float = 60
    ) -> list[Obj]:
        matcher = make_matcher(parse_label_selector(labels), [])
        self.settle_now()
        for pod in self.store.list(PODS, namespace, matcher):
            if pod["spec"].get("nodeName") and pod["status"].get("phase") == "Pending":
                self.kubelet.start(namespace, pod["metadata"]["name"])
        return await super().run_pods_to_ready(namespace, labels, count, timeout_s=timeout_s)

    async def complete_pods(
        self,
        namespace: str,
        labels: str | None = None,
        *,
        exit_code: int = 0,
        reason: str | None = None,
        timeout_s: float = 120,
    ) -> list[Obj]:
        matcher = make_matcher(parse_label_selector(labels), [])
        self.settle_now()
        finished: dict[str, Obj] = {}
        for pod in self.store.list(PODS, namespace, matcher):
            if pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp"):
                self.kubelet.finish(namespace, pod["metadata"]["name"], exit_code=exit_code, reason=reason)
                finished[pod["metadata"]["name"]] = self.store.get(PODS, namespace, pod["metadata"]["name"])
        return await self._wait_finished(namespace, labels, finished, timeout_s)

    async def close(self) -> None:
        self._unsubscribe()
        self._autopilot = 0
        if self._pending is not None:
            self._pending.cancel()
        if self._deadline is not None:
            self._deadline.cancel()
        await super().close()


class RealCluster(KubeCluster):
    """A real cluster from GPUQ_KUBECONFIG: the helpers wait for the real kubelet and controllers."""

    def __init__(self, kubeconfig: Path) -> None:
        config = KubeConfig.from_file(kubeconfig)
        cluster = config.get().cluster
        user = config.get().user
        super().__init__(
            KubeAccess(
                kubeconfig, str(cluster.server), getattr(user, "token", None), config.get().namespace or "default"
            )
        )

    async def cleanup(self) -> None:
        for name in reversed(self._namespaces):
            with contextlib.suppress(ApiError):
                await self.client().delete(LIGHTKUBE_KINDS[NAMESPACES], name)


def _pod_ready(pod: Obj) -> bool:
    ready = get_condition(pod, "Ready")
    return pod["status"].get("phase") == "Running" and ready is not None and ready.get("status") == "True"


def _as_dict(obj: Any) -> Obj:
    result: Obj = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
    return result
