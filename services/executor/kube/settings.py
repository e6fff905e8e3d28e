"""The Kubernetes executor's settings (services/stack.py builds them from the stack's)."""

from __future__ import annotations

from dataclasses import dataclass

from services.executor.kube.webhook import WebhookSettings
from shared.config import ClusterConfig, DcgmSettings, KubernetesSource, QueuesConfig


@dataclass
class KubeExecutorSettings:
    cluster: ClusterConfig
    queues: QueuesConfig
    tick_s: float = 1.0  # wall seconds between timer checks (PodsReady timeout, runtime limit, backoff)
    heartbeat_every_s: float | None = None  # wall seconds between heartbeats (None: GPUQ_HEARTBEAT_INTERVAL_S, 10)
    dcgm: DcgmSettings | None = None  # GPU utilisation and health from dcgm-exporter via Prometheus
    # The admission webhook this process serves (services/executor/kube/webhook.py); None = none. Where it runs,
    # the `gpuq.io/user` annotation is the user of record (the webhook writes it and refuses anyone else's).
    webhook: WebhookSettings | None = None

    @property
    def kube(self) -> KubernetesSource:
        return self.cluster.kube
