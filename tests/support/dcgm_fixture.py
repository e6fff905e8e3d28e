"""A fixture dcgm-exporter: serves `/metrics` in dcgm-exporter's exposition format, for a real Prometheus to scrape.

Written from the format as NVIDIA documents it (dcgm-exporter README and the GPU telemetry guide): one gauge per
DCGM field with `# HELP`/`# TYPE` lines, a series per GPU labelled `gpu`, `UUID`, `device`, `modelName`,
`Hostname`; on MIG-enabled GPUs a series for the whole GPU plus one per GPU instance with `GPU_I_PROFILE` and
`GPU_I_ID`; and, with Kubernetes pod mapping on, `container`, `namespace` and `pod` labels on the GPUs a pod
uses. The test changes values while it runs (e.g. an XID error) with `set`, pod mapping with `set_pod`, and adds
GPUs with `add`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HELP = {
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_XID_ERRORS": "Value of the last XID error encountered.",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "Ratio of time the graphics engine is active.",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "Ratio of cycles the tensor (HMMA) pipe is active.",
}


@dataclass
class FixtureGpu:
    """One GPU, or one MIG instance of it (`instance` set), with the values it reports."""

    host: str
    gpu: int
    model: str
    values: dict[str, float]
    instance: int | None = None
    profile: str | None = None
    pod: tuple[str, str, str] | None = None  # (namespace, pod, container) with pod mapping on
    uuid: str = ""

    def labels(self) -> dict[str, str]:
        out = {"gpu": str(self.gpu), "UUID": self.uuid or f"GPU-fixture-{self.host}-{self.gpu}",
               "device": f"nvidia{self.gpu}", "modelName": self.model, "Hostname": self.host}
        if self.instance is not None:
            out |= {"GPU_I_PROFILE": self.profile or "", "GPU_I_ID": str(self.instance)}
        namespace, pod, container = self.pod or ("", "", "")
        return out | {"container": container, "namespace": namespace, "pod": pod}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@dataclass
class FixtureExporter:
    gpus: list[FixtureGpu] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    scrapes: int = 0

    def set(self, host: str, gpu: int, metric: str, value: float, instance: int | None = None) -> None:
        with self._lock:
            hits = [g for g in self.gpus if g.host == host and g.gpu == gpu and g.instance == instance]
            assert hits, f"no fixture GPU {host}/{gpu}/{instance}"
            for g in hits:
                g.values[metric] = value

    def set_pod(self, host: str, gpu: int, pod: tuple[str, str, str] | None) -> None:
        """Pod mapping as dcgm-exporter learns it from the kubelet once a pod holds the GPU (None: no pod)."""
        with self._lock:
            hits = [g for g in self.gpus if g.host == host and g.gpu == gpu]
            assert hits, f"no fixture GPU {host}/{gpu}"
            for g in hits:
                g.pod = pod

    def add(self, gpu: FixtureGpu) -> None:
        with self._lock:
            self.gpus.append(gpu)

    def render(self) -> str:
        with self._lock:
            lines: list[str] = []
            for metric in sorted({m for g in self.gpus for m in g.values}):
                lines += [f"# HELP {metric} {HELP.get(metric, metric)}", f"# TYPE {metric} gauge"]
                for g in self.gpus:
                    if metric not in g.values:
                        continue
                    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in g.labels().items())
                    value = g.values[metric]
                    text = str(int(value)) if metric == "DCGM_FI_DEV_XID_ERRORS" else f"{value:.6f}"
                    lines.append(f"{metric}{{{labels}}} {text}")
            return "\n".join(lines) + "\n"

    def start(self) -> int:
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # the name http.server dispatches GET requests to
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = exporter.render().encode()
                exporter.scrapes += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return int(self._server.server_address[1])

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
