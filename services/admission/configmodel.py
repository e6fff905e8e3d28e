"""Admission's read model of the queue configuration, version 1 (the view `admission.v1_config`,
migrations/010_config_version.sql): every version admission recorded, the newest in force.

Admission is the configuration's one owner (docs/admission.md, "The configuration in force"): a queues.yaml file at
start, `gpuq apply-queues` and the API only propose; admission validates a proposal once and records it as the next
version (a number that only grows, and the content's hash, `shared.config.queues_hash`) unless its content is in
force already. The other services read the version in force here, at start and when admission publishes a version
(QueueConfigChanged with `config_version`), never from an event's content.

Readers see the owner's committed state when they read. Before admission has ever started on this database the view
does not exist and no version is known. This module imports nothing of admission's shell: any service may use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.admission.readmodel import Conn
from shared.config import QueuesConfig, parse_queues, queues_hash

CONFIG_VIEW = "admission.v1_config"


@dataclass(frozen=True)
class ConfigVersion:
    """One recorded version of the queue configuration."""

    version: int
    hash: str  # queues_hash of the document
    config: QueuesConfig
    applied_at: float  # epoch seconds, admission's clock
    applied_by: str  # who proposed it: an actor, or "file" for a queues.yaml read at start
    source: str  # file | change (gpuq apply-queues, the API) | "" for versions recorded before sources were

    def summary(self) -> str:
        return f"version {self.version} ({self.hash[:12]})"


async def published(conn: Conn) -> bool:
    """Has admission published its configuration read model on this database (its migrations ran)?"""
    return bool(await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", CONFIG_VIEW))


async def in_force(conn: Conn) -> ConfigVersion | None:
    """The version in force (the newest recorded), or None when admission has recorded none yet."""
    if not await published(conn):
        return None
    row = await conn.fetchrow(f"SELECT version, hash, document, applied_at, applied_by, source FROM {CONFIG_VIEW} "
                              "ORDER BY version DESC LIMIT 1")
    if row is None:
        return None
    config = parse_queues(json.loads(row["document"]), f"{CONFIG_VIEW} version {row['version']}")
    # A version recorded before hashes were has none until admission fills it in at its start: computed here.
    return ConfigVersion(version=row["version"], hash=row["hash"] or queues_hash(config), config=config,
                         applied_at=float(row["applied_at"]), applied_by=row["applied_by"], source=row["source"] or "")


async def version_of(conn: Conn, content_hash: str) -> int | None:
    """The newest version whose content has this hash, if any was ever recorded."""
    if not await published(conn):
        return None
    found = await conn.fetchval(f"SELECT max(version) FROM {CONFIG_VIEW} WHERE hash = $1", content_hash)
    return int(found) if found is not None else None
