"""gpuq's helper for training code running in a pod. It imports nothing of gpuq and nothing outside the standard
library, so any training image can carry it (copy this one file, or `pip install gpuq`).

    import gpuq_sdk

    start = gpuq_sdk.resume_from()            # None on a first start, else the checkpoint URI to load
    for step in ...:
        ...
        if gpuq_sdk.checkpoint_requested():   # gpuq wants the GPUs back: save now
            uri = save_checkpoint(step)
            gpuq_sdk.report_checkpoint(uri, step=step)
            break                             # (or keep going until SIGTERM; the pod is stopped either way)
        if gpuq_sdk.target_pods() != world:   # an elastic job was grown or shrunk: re-form the process group
            ...

The pod needs the downward-API annotations file (a `downwardAPI` volume with `metadata.annotations`, mounted at
/etc/podinfo by default, or GPUQ_ANNOTATIONS_FILE) and a service account allowed to patch its own pod
(docs/kubernetes.md). `report_checkpoint` patches the pod's annotation `gpuq.io/last-checkpoint`; gpuq's executor
turns that into a JobCheckpointed event and then suspends the workload.

Producers (pipelines, scripts) submit, watch and cancel jobs with `gpuq_sdk.Client` / `gpuq_sdk.AsyncClient`
(gpuq_sdk/client.py, which needs httpx): imported on first use, so that the helper above stays standard-library only.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuq_sdk.client import (
        AsyncClient,
        Client,
        GpuqError,
        SubmissionRefused,
        Submitted,
        WaitTimeout,
        job_spec,
    )

__all__ = ["AsyncClient", "CheckpointReportError", "Client", "GpuqError", "SubmissionRefused", "Submitted",
           "WaitTimeout", "checkpoint_deadline", "checkpoint_requested", "job_spec", "pod_annotations",
           "report_checkpoint", "resume_from", "target_pods", "target_pods_by_set"]
_PRODUCER = frozenset({"AsyncClient", "Client", "GpuqError", "SubmissionRefused", "Submitted", "WaitTimeout",
                       "job_spec"})


def __getattr__(name: str) -> Any:
    """The producer SDK's names, imported when first asked for (see the module's docstring)."""
    if name in _PRODUCER:
        from gpuq_sdk import client

        return getattr(client, name)
    raise AttributeError(f"module 'gpuq_sdk' has no attribute {name!r}")

ANNOTATIONS_FILE = Path(os.environ.get("GPUQ_ANNOTATIONS_FILE", "/etc/podinfo/annotations"))
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
CHECKPOINT_REQUESTED = "gpuq.io/checkpoint-requested"
LAST_CHECKPOINT = "gpuq.io/last-checkpoint"
LAST_CHECKPOINT_STEP = "gpuq.io/last-checkpoint-step"
RESUME_FROM = "gpuq.io/resume-from"
TARGET_PODS = "gpuq.io/target-pods"
TARGET_PODS_BY_SET = "gpuq.io/target-pods-by-set"
RESUME_ENV = "GPUQ_RESUME_FROM"


class CheckpointReportError(RuntimeError):
    """The pod's annotation could not be written; the message says why (permissions, API unreachable, ...)."""


def pod_annotations(path: str | Path | None = None) -> dict[str, str]:
    """The pod's annotations as the downward API writes them: one `key="value"` per line (Go-quoted values).
    An absent file reads as no annotations."""
    try:
        text = Path(path or ANNOTATIONS_FILE).read_text()
    except FileNotFoundError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        value = value.strip()
        try:
            out[key.strip()] = json.loads(value) if value.startswith('"') else value
        except ValueError:
            out[key.strip()] = value.strip('"')
    return out


def checkpoint_deadline(path: str | Path | None = None) -> datetime | None:
    """When gpuq preempts the job if it has not checkpointed (None: no checkpoint is requested)."""
    raw = pod_annotations(path).get(CHECKPOINT_REQUESTED)
    if not raw:
        return None
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return datetime.now(timezone.utc)  # noqa: UP017 (the SDK also runs on Python < 3.11)


def checkpoint_requested(path: str | Path | None = None) -> bool:
    """Whether gpuq asked this job to checkpoint (it wants the GPUs back)."""
    return checkpoint_deadline(path) is not None


def target_pods(path: str | Path | None = None) -> int | None:
    """An elastic job's size now: the pods it runs with in all, as gpuq last started, grew or shrank it (None: the
    job is not elastic, or the annotation is not there yet). Compare it with the world size you run with."""
    raw = pod_annotations(path).get(TARGET_PODS)
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def target_pods_by_set(path: str | Path | None = None) -> dict[str, int]:
    """Per elastic pod set (e.g. {"worker": 6}), the pods it runs with now; {} when not elastic."""
    out: dict[str, int] = {}
    for item in (pod_annotations(path).get(TARGET_PODS_BY_SET) or "").split(","):
        name, sep, count = item.partition("=")
        if sep and count.strip().isdigit():
            out[name.strip()] = int(count)
    return out


def resume_from(path: str | Path | None = None) -> str | None:
    """The checkpoint to resume from: GPUQ_RESUME_FROM, else the pod's `gpuq.io/resume-from` annotation."""
    value = os.environ.get(RESUME_ENV) or pod_annotations(path).get(RESUME_FROM)
    return value or None


def report_checkpoint(uri: str, step: int | None = None, *, pod: str | None = None, namespace: str | None = None,
                      api_url: str | None = None, token: str | None = None, ca_file: str | None = None,
                      timeout_s: float = 10.0) -> None:
    """Record `uri` as this pod's last checkpoint (annotation `gpuq.io/last-checkpoint`), through the in-cluster
    API with the pod's service-account token. Every argument defaults to what the pod itself provides (POD_NAME
    or the hostname, the service account's namespace, token and CA, KUBERNETES_SERVICE_HOST/PORT)."""
    if not uri:
        raise ValueError("report_checkpoint needs the checkpoint's URI")
    pod = pod or os.environ.get("POD_NAME") or socket.gethostname()
    namespace = namespace or os.environ.get("POD_NAMESPACE") or _read(SERVICE_ACCOUNT / "namespace")
    token = token if token is not None else _read(SERVICE_ACCOUNT / "token")
    if api_url is None:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise CheckpointReportError("not in a pod: KUBERNETES_SERVICE_HOST is unset (pass api_url=...)")
        api_url = f"https://{host}:{port}"
        ca_file = ca_file or str(SERVICE_ACCOUNT / "ca.crt")
    notes = {LAST_CHECKPOINT: uri}
    if step is not None:
        notes[LAST_CHECKPOINT_STEP] = str(int(step))
    body = json.dumps({"metadata": {"annotations": notes}}).encode()
    request = urllib.request.Request(
        f"{api_url.rstrip('/')}/api/v1/namespaces/{namespace}/pods/{pod}", data=body, method="PATCH",
        headers={"Content-Type": "application/merge-patch+json", "Accept": "application/json",
                 **({"Authorization": f"Bearer {token}"} if token else {})})
    context = ssl.create_default_context(cafile=ca_file) if api_url.startswith("https") else None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise CheckpointReportError(f"PATCH pod {namespace}/{pod} answered {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise CheckpointReportError(f"cannot reach the Kubernetes API at {api_url}: {exc}") from None


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
