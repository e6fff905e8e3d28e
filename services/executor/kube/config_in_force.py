"""The queue configuration the Kubernetes executor judges workloads and creates jobs under: admission's version in
force (services/admission/follow.py), or queues.yaml until admission has recorded one. The admission webhook this
process serves, if any, judges under the same version."""

from __future__ import annotations

import dataclasses

from services.admission.follow import ConfigFollower
from services.executor.kube.webhook import WebhookServer
from shared.config import QueuesConfig
from shared.events import CloudEvent, QueueConfigChanged
from shared.service import Tx


class ConfigInForce:
    def __init__(self, queues: QueuesConfig):
        # Namespace mappings, governance and priority classes: admission's version in force; queues.yaml serves
        # until admission has recorded one.
        self.follower = ConfigFollower("executor", queues)
        self.webhook: WebhookServer | None = None  # the admission webhook, when this process serves it

    @property
    def queues(self) -> QueuesConfig:
        return self.follower.config

    async def newer(self, tx: Tx) -> bool:
        """Before refusing what the configuration decides: is a newer version in force than the one this executor
        runs on? (Its publication travels on another stream than the jobs and workloads it concerns.)"""
        if not await self.follower.refresh(tx.conn):
            return False
        self.configure_webhook()
        return True

    def words(self) -> str:
        version = self.follower.version
        return f"version {version}" if version is not None else "queues.yaml: no version recorded yet"

    def configure_webhook(self) -> None:
        if self.webhook is not None and self.webhook.policy.queues is not self.queues:
            self.webhook.policy = dataclasses.replace(self.webhook.policy, queues=self.queues)

    async def on_config_changed(self, tx: Tx, event: CloudEvent, payload: QueueConfigChanged) -> None:
        """Admission published a version: workloads are judged and jobs created under it from now on."""
        if await self.follower.on_changed(tx, event, payload):
            self.configure_webhook()
