"""Time to a first admitted job from `helm install`, on the fake cluster (docs/install.md, "How long from `helm
install` to a first job").

There is no real Kubernetes here, so the install is played as the cluster would play it, with the chart's own
output: `helm template` renders the release (the CI values: a production-shaped install, Kubernetes executor, a bus
user per service), what the fake API server of tests/kube/kubefake enforces is applied to it (the release's namespace,
ServiceAccounts, ClusterRoles and bindings), and each rendered Deployment's pod is started as a process running its
container's own command line and environment (`gpuq up --services=…`, Secrets and the ConfigMap resolved to this
machine's NATS, Postgres and files; one replica each, as the first job needs only the leaders), the executor and the
API with their ServiceAccounts' tokens. Once every pod is ready (`helm install --wait`), the test hook's pod runs:
`gpuq smoke` with its rendered arguments, which submits a 1-GPU job through the API and waits for it to be placed on
one of the fake cluster's H100 nodes. The figures printed: seconds from the start of `helm template` to every pod
ready, to the job admitted (admission's own timestamp) and placed (the scheduler's), and the smoke's whole run.

What this leaves out, and says so in docs/install.md: pulling the image and starting containers (the pods are
processes of this machine's Python, all on its CPUs at once, where a cluster gives each pod its own requests), the
API server's own work on the release's other objects, and the admission webhook (`webhook.enabled=false`: the fake
API server calls a webhook by URL, not through a Service, and the webhook changes nothing on the way to a first job
submitted through the API). NATS and Postgres are prerequisites, running before the install, as the guide orders."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from shared import namespace as namespaces
from shared.servers import free_port
from tests.deploy.test_chart import CI_VALUES
from tests.deploy.test_rbac_enforced import as_service_account, install_identities
from tests.kube.kubefake.cluster import KubeCluster
from tests.kube_support import BLOCK, H100, RACK, eventually

Doc = dict[str, Any]
GPUQ = Path(sys.executable).parent / "gpuq"
# The values of the measured install: the CI values, on this machine's single NATS server (no replicated streams),
# in this test session's bus namespace, without the admission webhook (see the docstring).
SETS = ["streams.natsClustered=false", "webhook.enabled=false"]


class PodProcess:
    """One rendered Deployment's pod, as a process: its container's args and env, with what only a cluster provides
    (Secrets, the ConfigMap's files, the pod's name, its ports) resolved here."""

    def __init__(self, deployment: Doc, workdir: Path, resolve: dict[str, str], kubeconfig: Path | None):
        self.name = deployment["metadata"]["name"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        self.health_port = free_port()
        self.api_port: int | None = None
        self.ready_at: float | None = None
        self.cpu_s: float | None = None
        args = [self._arg(a, workdir) for a in container["args"]]
        if kubeconfig is not None:  # in a cluster: the ServiceAccount's mounted token; here its kubeconfig
            args.append(f"--kubeconfig={kubeconfig}")
        env = {**os.environ, **{e["name"]: self._env(e, resolve) for e in container.get("env", [])}}
        self.log = workdir / f"{self.name}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen([str(GPUQ), *args], env={**env, "PYTHONUNBUFFERED": "1"}, cwd=workdir,
                                         stdout=out, stderr=subprocess.STDOUT)

    def _arg(self, arg: str, workdir: Path) -> str:
        flag, _, value = arg.partition("=")
        if flag == "--health-port":
            return f"{flag}={self.health_port}"
        if flag == "--api-port":
            self.api_port = free_port()
            return f"{flag}={self.api_port}"
        if flag == "--metrics-port":
            return f"{flag}={free_port()}"
        if flag == "--bind":
            return f"{flag}=127.0.0.1"
        return f"{flag}={value.replace('/etc/gpuq/', f'{workdir}/etc-gpuq/')}" if value else arg

    def _env(self, entry: Doc, resolve: dict[str, str]) -> str:
        if "value" in entry:
            return str(resolve.get(entry["value"], entry["value"]))
        source = entry["valueFrom"]
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name", source
            return f"{self.name}-0"
        ref = source["secretKeyRef"]
        return resolve[f"secret:{ref['name']}:{ref['key']}"]

    async def ready(self, start: float) -> bool:
        """Ready (/readyz); the first time, when (seconds since `start`) and after how much CPU time are kept."""
        assert self.proc.poll() is None, f"{self.name} exited:\n{self.log.read_text()[-3000:]}"
        if self.ready_at is not None:
            return True
        try:
            async with httpx.AsyncClient() as client:
                ok = (await client.get(f"http://127.0.0.1:{self.health_port}/readyz", timeout=5)).status_code == 200
        except httpx.TransportError:
            return False
        if ok:
            self.ready_at, self.cpu_s = time.monotonic() - start, cpu_seconds(self.proc.pid)
        return ok

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user and system) a process has used so far (Linux's /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rendered_files(docs: list[Doc], workdir: Path) -> None:
    """The ConfigMap the pods mount at /etc/gpuq, written where their rewritten arguments look."""
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    target = workdir / "etc-gpuq"
    target.mkdir()
    for name, text in config["data"].items():
        (target / name).write_text(text)


async def test_time_to_a_first_admitted_job_from_helm_install(
        render: Any, fresh: tuple[str, str], kube_api: KubeCluster, tmp_path: Path) -> None:
    nats_url, database_url = fresh
    # The cluster as the guide's prerequisites leave it: GPU nodes (GPU Operator / GFD labels), the managed
    # namespaces, NATS and Postgres running, the Secrets created.
    for i in range(1, 4):
        kube_api.fake.add_node(f"gpu-{i}", gpus=8, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    for ns in ("ml-vision", "ml-nlp"):
        await kube_api.create_namespace(ns)
    key_file = tmp_path / "secrets.key"
    key_file.write_text(os.environ["GPUQ_SECRETS_KEY"])
    resolve = {"secret:gpuq-database:uri": database_url, "/etc/gpuq-secrets/secrets.key": str(key_file),
               **{f"secret:gpuq-nats-{user}:url": nats_url for user in
                  ("admission", "scheduler", "preemption", "metering", "telemetry", "kube", "audit", "api")}}
    pods: list[PodProcess] = []
    async with kube_api.autopilot():
        try:
            load = os.getloadavg()[0]
            t0 = time.time()
            start = time.monotonic()
            # helm install: render, then what the API server stores (here, what the fake enforces: the identities).
            docs = render(CI_VALUES, sets=[*SETS, f"platformNamespace={namespaces.current()}"])
            await install_identities(kube_api, docs)
            rendered_files(docs, tmp_path)
            kubeconfigs = {"gpuq-executor": await as_service_account(kube_api, "gpuq-executor", tmp_path),
                           "gpuq-api": await as_service_account(kube_api, "gpuq-api", tmp_path)}
            installed = time.monotonic() - start
            pods = [PodProcess(d, tmp_path, resolve, kubeconfigs.get(d["metadata"]["name"]))
                    for d in docs if d["kind"] == "Deployment"]

            async def all_ready() -> bool:
                return all(await asyncio.gather(*(p.ready(start) for p in pods)))
            await eventually("every pod ready", all_ready, timeout_s=240)
            ready = time.monotonic() - start
            # helm test: the hook's pod, its rendered arguments (the API's Service address: this machine's port).
            hook = next(d for d in docs if d["kind"] == "Pod")
            api = next(p for p in pods if p.api_port is not None)
            args = [re.sub(r"^--api-url=.*", f"--api-url=http://127.0.0.1:{api.api_port}", a)
                    for a in hook["spec"]["containers"][0]["args"]]
            smoke = await asyncio.to_thread(
                subprocess.run, [str(GPUQ), *args, "--poll=0.2"], capture_output=True, text=True, timeout=300,
                env={**os.environ, "DATABASE_URL": database_url, "COLUMNS": "200"})
            smoked = time.monotonic() - start
            assert smoke.returncode == 0, smoke.stdout + smoke.stderr
            job_id = re.search(r"smoke: submitted (\S+)", smoke.stderr)
            assert job_id, smoke.stderr
            conn = await asyncpg.connect(database_url)
            try:
                admitted = await conn.fetchval("SELECT admitted_at FROM admission.jobs WHERE job_id = $1",
                                               job_id.group(1))
                placed = await conn.fetchval("SELECT placed_at FROM scheduler.jobs WHERE job_id = $1", job_id.group(1))
            finally:
                await conn.close()
        finally:
            for pod in pods:
                pod.stop()
    assert admitted is not None and placed is not None
    per_pod = ", ".join(f"{p.name.removeprefix('gpuq-')} {p.ready_at:.1f} s"
                        + (f" ({p.cpu_s:.1f} CPU-s)" if p.cpu_s is not None else "")
                        for p in sorted(pods, key=lambda p: p.ready_at or 0.0))
    print(f"\ntime to a first admitted job from helm install, on the fake cluster: {admitted - t0:.1f} s\n"
          f"  helm template and the identities applied: {installed:.1f} s\n"
          f"  {len(pods)} pods ready (helm install --wait): {ready:.1f} s; each ready at (CPU time used): {per_pod}\n"
          f"  helm test: the smoke's job admitted at {admitted - t0:.1f} s, placed at {placed - t0:.1f} s; "
          f"cancelled and its token revoked at {smoked:.1f} s\n"
          f"  on {os.cpu_count()} CPUs, load average {load:.1f} before the install")
    assert t0 < admitted <= placed
