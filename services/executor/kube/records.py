"""The Kubernetes executor's job records (`executor.kube_jobs`) as its parts read them: the states that group them,
the annotation a pod's binding is written in, and the row helpers every part shares."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import asyncpg

from shared.domain import GpuBinding

ACTIVE = ("placed", "running")
STOPPED = ("suspended", "failed", "cancelled")  # suspended by gpuq: its templates are restored
ENDED = ("failed", "rejected")  # gpuq's verdict is final: the workload is shown failed (`Outcomes.conclude`)
BINDING_ANNOTATION = "gpuq.io/binding"  # on a pod: "<attempt>/<binding pod id>" it was given


def ref_of(row: asyncpg.Record | dict[str, Any]) -> dict[str, Any]:
    """The workload a job record is bound to, as the notices name it."""
    return {"apiVersion": row["api_version"], "kind": row["kind"], "namespace": row["namespace"],
            "name": row["name"], "uid": row["uid"]}


def strip_nulls(value: Any) -> Any:
    """Objects POSTed to the API carry no nulls (a merge patch's null means delete; a create's is invalid)."""
    if isinstance(value, dict):
        return {k: strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_nulls(v) for v in value]
    return value


def bindings_of(row: asyncpg.Record) -> list[GpuBinding]:
    return [GpuBinding.model_validate(b) for b in json.loads(row["placement"] or "[]")]


def rfc3339(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def creation_time(obj: dict[str, Any]) -> datetime | None:
    raw = (obj.get("metadata") or {}).get("creationTimestamp")
    if not raw:
        return None
    try:
        return datetime.fromisoformat(str(raw).replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None
