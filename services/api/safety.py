"""Routes that catch mistakes before they land: the check of a proposed queue configuration against the live
cluster (what `gpuq apply-queues --dry-run` prints through the API), and the dead letters a caller may see.

A router of its own, included by services/api/app.py (`app.include_router(safety.router(principal))`): it reads
the caller from the same bearer-token dependency and the pool from the app's context.
"""

# No `from __future__ import annotations`: FastAPI resolves the routes' annotations in the module's globals, where the
# `caller` alias local to router() is not (the OpenAPI document could not be generated).
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BaseModel

from services.admission.changecheck import check_proposal
from services.api.tokens import Principal
from shared import deadletters
from shared.config import ConfigError, parse_queues


class ConfigToCheck(BaseModel):
    config: dict[str, Any]


class ConfigCheckResult(BaseModel):
    """What the proposal changes against the version in force, and what admission would warn about or refuse
    (refused unless forced: PUT /v1/queues/config with `force: true`)."""

    diff: list[str]
    warnings: list[str]
    refusals: list[str]


class DeadLetterRow(BaseModel):
    service: str
    id: int
    at: datetime
    subject: str
    stream_seq: int | None
    deliveries: int
    reason: str
    message: str
    body_bytes: int
    body_preview: str


def router(principal: Callable[..., Awaitable[Principal]]) -> APIRouter:
    caller = Annotated[Principal, Depends(principal)]
    r = APIRouter()

    @r.post("/v1/queues/config/check", response_model=ConfigCheckResult,
            summary="Check a queue configuration against the version in force and the live cluster (admin)")
    async def check_config(who: caller, body: ConfigToCheck, request: Request) -> ConfigCheckResult:
        if not who.admin:
            raise HTTPException(403, "this needs a platform admin's token")
        try:
            config = parse_queues(body.config, "request body")
        except ConfigError as exc:
            raise HTTPException(422, str(exc)) from None
        async with request.app.state.ctx.rt().pool.acquire() as conn:
            checked = await check_proposal(conn, config)
        return ConfigCheckResult(diff=list(checked.diff), warnings=list(checked.warnings),
                                 refusals=list(checked.refusals))

    @r.get("/v1/dead-letters", response_model=list[DeadLetterRow],
           summary="Recent dead letters with their reasons (the token's team's subjects; every one for an admin)")
    async def dead_letters(who: caller, request: Request,
                           limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                           reason: str | None = None) -> list[DeadLetterRow]:
        if not who.admin and not who.team:
            return []  # a token of no team publishes on no team's subjects
        async with request.app.state.ctx.rt().pool.acquire() as conn:
            rows = await deadletters.recent(conn, team=None if who.admin else who.team, limit=limit, reason=reason)
        return [DeadLetterRow(**vars(d)) for d in rows]

    return r
