"""Audit records: every service records what it did or refused, with the actor's authenticated identity, as an
`AuditRecorded` event in the same transaction as the action (its outbox), on `<ns>.audit.recorded.<service>`.
The audit service is the one writer of the append-only table; a SIEM may subscribe to the subject too.

Actors are written as `<kind>:<name>`: `team:<team>` (the team's bus credential, the only one besides trusted
producers that may publish on the team's subjects), `token:<name>` and `admin:<name>` (API bearer tokens),
`service:<name>` (a gpuq service acting on its own decision)."""

from __future__ import annotations

from typing import Any

from shared.events import AuditRecorded, utcnow_from
from shared.service import Tx


def team_actor(team: str) -> str:
    return f"team:{team}"


def service_actor(name: str) -> str:
    return f"service:{name}"


async def record(tx: Tx, action: str, actor: str, *, job_id: str | None = None, team: str | None = None,
                 **detail: Any) -> None:
    """Emit one audit record from this unit of work (published only if it commits). The recorder is the service
    whose schema the transaction works in."""
    await tx.emit(AuditRecorded(action=action, actor=actor, at=utcnow_from(tx.now), job_id=job_id, team=team,
                                detail={k: v for k, v in sorted(detail.items()) if v is not None}),
                  subject_suffix=tx.schema)
