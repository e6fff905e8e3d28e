"""How a service other than admission runs on the queue configuration in force (docs/admission.md, "The
configuration in force").

Admission owns the configuration: it records each version and publishes it (QueueConfigChanged with
`config_version`). A follower (the scheduler, preemption, the Kubernetes executor) runs on the version in force,
read from admission's read model (services/admission/configmodel.py) at start and whenever a publication arrives;
it never applies an event's content, nor a proposal (a QueueConfigChanged without a version: admission decides). Its
own queues.yaml, read at start, serves only until admission has recorded a first version; when it differs from the
version in force the follower says so loudly (log, /readyz, `gpuq_config_file_differs`): admission records a
changed file at its own start, and an earlier version's file (an old pod's) is never applied.
"""

from __future__ import annotations

import logging

from services.admission import configmodel
from services.admission.readmodel import Conn
from shared.config import QueuesConfig, queues_hash
from shared.events import CloudEvent, QueueConfigChanged
from shared.health import CONFIG_STATE_KEY, ConfigInForce
from shared.service import ServiceRuntime, Tx

log = logging.getLogger("gpuq.config")


class ConfigFollower:
    def __init__(self, service: str, file: QueuesConfig):
        self.service = service
        self.file_hash = queues_hash(file)
        self.config = file  # what the service runs on: its file until a version is known
        self.version: int | None = None
        self.hash = self.file_hash
        self.file_version: int | None = None  # the version whose content the file is, if any

    async def start(self, runtime: ServiceRuntime) -> None:
        """At the service's start (and a standby's takeover): the version in force, or the file while none is."""
        async with runtime.pool.acquire() as conn:
            await self.load(conn)
        runtime.state[CONFIG_STATE_KEY] = self.report

    async def load(self, conn: Conn) -> None:
        current = await configmodel.in_force(conn)
        if current is None:
            log.info("%s: no queue configuration version recorded yet: running on queues.yaml (%s) until admission "
                     "records one", self.service, self.file_hash[:12])
            return
        self._take(current)
        if current.hash != self.file_hash:
            self.file_version = await configmodel.version_of(conn, self.file_hash)
            log.warning("%s: queues.yaml (%s) is not the queue configuration in force: running on %s. %s",
                        self.service, self.file_hash[:12], current.summary(), self._file_words(current.version))

    async def on_changed(self, tx: Tx, event: CloudEvent, payload: QueueConfigChanged) -> bool:
        """A QueueConfigChanged: True when it moved this service to a newer version. A proposal changes nothing here
        (admission judges it and publishes the version it records); a publication is a cue to read the version in
        force, whatever the event claims."""
        if payload.config_version is None:
            return False
        return await self.refresh(tx.conn)

    async def refresh(self, conn: Conn) -> bool:
        """Take the version in force if it is newer than the one this service runs on (also called before refusing
        something the configuration decides, since a publication travels on another stream than the jobs it
        concerns)."""
        current = await configmodel.in_force(conn)
        if current is None or (self.version is not None and current.version <= self.version):
            return False
        previous = self.version
        self._take(current)
        self.file_version = await configmodel.version_of(conn, self.file_hash)
        log.info("%s: now on queue configuration %s (was %s)", self.service, current.summary(),
                 f"version {previous}" if previous is not None else "queues.yaml")
        return True

    def _take(self, current: configmodel.ConfigVersion) -> None:
        self.config, self.version, self.hash = current.config, current.version, current.hash

    def _file_words(self, in_force: int) -> str:
        if self.file_version is not None and self.file_version < in_force:
            return (f"The file is version {self.file_version}'s content, an older one (an old ConfigMap: this pod "
                    "predates the change) and is not applied.")
        return ("The file was never recorded: admission records a changed queues.yaml at its own start (a helm "
                "upgrade restarts it too), or apply it with gpuq apply-queues.")

    def report(self) -> ConfigInForce:
        differs = self.hash != self.file_hash
        where = f"version {self.version}" if self.version is not None else "no version recorded yet: queues.yaml"
        if differs and self.version is not None:
            where += " (queues.yaml differs: " + ("an older version's" if self.file_version is not None
                                                   and self.file_version < self.version else "not recorded") + ")"
        return ConfigInForce(version=self.version, hash=self.hash, file_differs=differs, detail=where)
