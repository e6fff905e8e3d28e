"""The API service: an HTTP API (FastAPI, OpenAPI at /openapi.json) for people, the CLI and the producer SDK
(gpuq_sdk.Client). Swagger UI at /docs and ReDoc at /redoc are served with their files (no CDN: they work offline).

Callers present a bearer token (services/api/tokens.py). A team's token sees and acts on that team's jobs,
reports, webhooks and audit records only; another team's job is "not found" to it. Its submissions need not name
their team, nor their queue (the team's default queue: `_default_queue`). An admin token sees everything
and may approve jobs and change the queue configuration.

What callers ask for goes on the bus from this service's outbox, in the transaction that audits it: submissions
on `<ns>.job.submitted.<team>` (the team is the token's, never the body's), cancel requests on
`<ns>.job.cancel_requested.<team>` (the job's team, which admission checks again), approvals and configuration
changes for admins. Reads are the services' tables (services/api/readmodel.py), read-only.

Environment: DATABASE_URL, NATS_URL (the `api` bus user's credentials on an authenticated server), GPUQ_API_PORT
(default 8000), GPUQ_NAMESPACE; `gpuq up --services api` runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import asyncpg
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError

from services.admission import configmodel, queuemodel
from services.admission.changecheck import check_proposal
from services.api import portal, readmodel, safety, tokens
from services.api.kubeauth import NoTeam, ReviewUnavailable, TokenReviewer, TokenReviewSettings, principal_for
from services.api.limits import BodyLimit, max_body_bytes_from_env
from services.api.models import (
    AuditRecord,
    CancelBody,
    ConfigBody,
    ConfigInForce,
    ConfigProposed,
    Explanation,
    FocusRow,
    HeldOutside,
    JobRequestSent,
    JobStatus,
    QueueRow,
    Report,
    Submission,
    SubmitResult,
    Webhook,
    WebhookBody,
    WebhookChanged,
    WebhookCreated,
    WebhookRotated,
    job_request_schemas,
)
from services.api.tokens import Principal
from services.audit.records import read_records
from services.core.admission import governance, identity
from services.core.metering.rollup import Granularity
from services.metering import budgetmodel
from services.scheduler import readmodel as scheduler_view
from services.telemetry.webhooks import store as webhooks
from shared import audit
from shared.config import ConfigError, QueuesConfig, parse_queues, queues_document, queues_hash
from shared.domain import JobSpec
from shared.events import (
    MAX_DEPTH,
    JobApproved,
    JobCancelRequested,
    JobSubmitted,
    QueueConfigChanged,
    too_deep,
    utcnow_from,
)
from shared.service import ServiceRuntime, ServiceSpec

log = logging.getLogger("gpuq.api")
MIGRATIONS = Path(__file__).parent / "migrations"
DEFAULT_PORT = 8000
VERDICT_WAIT_S = 5.0  # how long POST /v1/jobs waits for admission's verdict before answering "accepted"


# Swagger UI's and ReDoc's scripts and styles, served by this service so that /docs and /redoc work without network
# (FastAPI's defaults load them from a CDN). The fastapi-offline package ships them (Swagger UI: Apache-2.0, ReDoc:
# MIT); only its files are used.
DOCS_STATIC_URL = "/docs-static"


def _docs_assets() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


@dataclass
class ApiContext:
    database_url: str
    runtime: ServiceRuntime | None = None
    queues: QueuesConfig | None = None  # the configuration started with (admission's latest one wins)
    reviewer: TokenReviewer | None = None  # Kubernetes tokens (services/api/kubeauth.py), when enabled

    def rt(self) -> ServiceRuntime:
        if self.runtime is None:
            raise HTTPException(503, "the API is starting")
        return self.runtime


bearer = HTTPBearer(auto_error=False, description="`gpuq tokens create` issues tokens: gpuq_<id>.<secret>")


async def principal(request: Request,
                    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
    """The caller, from its bearer token: a gpuq token, or (with TokenReview on) a Kubernetes one. 401 for a token
    nobody vouches for, 403 for a Kubernetes identity that maps to no team."""
    if creds is None:
        raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
    ctx: ApiContext = request.app.state.ctx
    if ctx.reviewer is not None and not creds.credentials.startswith(tokens.PREFIX):
        return await _kube_principal(ctx, ctx.reviewer, creds.credentials)
    async with ctx.rt().pool.acquire() as conn:
        who = await tokens.authenticate(conn, creds.credentials, datetime.now(UTC))
    if who is None:
        raise HTTPException(401, "unknown, expired or revoked token", headers={"WWW-Authenticate": "Bearer"})
    return who


async def _kube_principal(ctx: ApiContext, reviewer: TokenReviewer, token: str) -> Principal:
    try:
        user = await reviewer.review(token)
    except ReviewUnavailable as exc:
        log.warning("%s", exc)
        raise HTTPException(503, f"cannot verify the token now: {exc}") from None
    if user is None:
        raise HTTPException(401, "the Kubernetes API does not accept this token"
                            + (f" for audience {', '.join(reviewer.settings.audiences)}"
                               if reviewer.settings.audiences else ""), headers={"WWW-Authenticate": "Bearer"})
    config = await _current_config(ctx) or ctx.queues
    who = principal_for(user, config.namespaces if config is not None else (), reviewer.settings)
    if isinstance(who, NoTeam):
        raise HTTPException(403, who.reason)
    return who


async def _current_config(ctx: ApiContext) -> QueuesConfig | None:
    """Admission's current queues configuration (changed at runtime by QueueConfigChanged), if it has one."""
    async with ctx.rt().pool.acquire() as conn:
        current = await configmodel.in_force(conn)
    return current.config if current is not None else None


Caller = Annotated[Principal, Depends(principal)]


def create_app(ctx: ApiContext) -> FastAPI:
    app = FastAPI(title="gpuq API", version="1", description=__doc__, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes_from_env())  # 413 before any body is buffered
    _offline_docs(app)
    app.include_router(safety.router(principal))  # the configuration check and the dead letters

    # The routes, by area, in the order FastAPI matches them and the OpenAPI document lists them.
    _add_job_routes(app, ctx)
    _add_job_request_routes(app, ctx)
    _add_queue_routes(app, ctx)
    _add_report_routes(app, ctx)
    _add_webhook_routes(app, ctx)
    _add_audit_routes(app, ctx)

    _document_submission_body(app)
    portal.mount(app, principal)  # the web UI under /ui (services/api/portal)
    return app


def _admin_only(who: Principal) -> None:
    if not who.admin:
        raise HTTPException(403, "this needs a platform admin's token")


async def _visible_job(ctx: ApiContext, who: Principal, job_id: str) -> dict[str, Any]:
    rows = await readmodel.fetch_status(ctx.database_url, job_id, team=None if who.admin else who.team)
    if not rows:
        raise HTTPException(404, f"no job {job_id!r}")  # another team's job is not found, not forbidden
    return rows[0]


def _add_job_routes(app: FastAPI, ctx: ApiContext) -> None:
    """The health probe, submission and the jobs' status and explanation."""

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/jobs", status_code=202, response_model=list[SubmitResult],
              summary="Submit jobs (one JobSpec, a list, or {jobs: [...]}) as the token's team",
              description="`team` defaults to the token's team and `queue` to that team's default queue; `job_id` to "
                          "a fresh one. Answers admission's verdict on each, waiting up to `wait` seconds for it.")
    async def submit(who: Caller, request: Request,
                     wait: Annotated[float, Query(ge=0, le=30)] = VERDICT_WAIT_S) -> list[SubmitResult]:
        config = await _current_config(ctx) or ctx.queues
        specs = _specs_from_body(await _json_body(request), who, config)
        for spec in specs:
            if not who.admin and spec.team != who.team:
                raise HTTPException(403, f"job {spec.job_id} names team {spec.team!r}; this token submits for team "
                                         f"{who.team!r} only")
            # (admission judges it again, with the same functions, on its configuration then)
            violation = governance.size_violation(spec) if config is None else governance.submission_violation(
                spec, config.governance.for_team(spec.team), config.team_namespaces(spec.team),
                cpu_queue=governance.charges_cpu(config, spec.queue))
            if violation is not None:
                raise HTTPException(422, f"{violation.reason}: {violation.message}")
        async with ctx.rt().pool.acquire() as conn:
            known = await _known_jobs(conn, [s.job_id for s in specs])
        _refuse_taken_ids(specs, known)
        events = []
        async with ctx.rt().transaction() as tx:
            for spec in specs:
                event = await tx.emit(JobSubmitted(spec=spec, submitted_at=utcnow_from(tx.now), submitted_by=who.actor),
                                      subject_suffix=spec.team)
                await audit.record(tx, "submit_request", who.actor, job_id=spec.job_id, team=spec.team,
                                   event_id=event.id)
                events.append((spec.job_id, event.id))
        return await _verdicts(ctx, events, wait)

    @app.get("/v1/jobs", summary="Jobs of the token's team (all teams for an admin)", response_model=list[JobStatus])
    async def list_jobs(who: Caller, all_jobs: Annotated[bool, Query(alias="all")] = False,
                        limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
                        team: str | None = None) -> list[dict[str, Any]]:
        scope = team if who.admin else who.team
        rows = await readmodel.fetch_status(ctx.database_url, None, limit=limit * 50, team=scope)
        if not all_jobs:
            rows = [r for r in rows if r["state"] in ("pending", "admitted", "placed", "running")]
        now = ctx.rt().clock.now()  # the platform's clock, which the stored times and ETAs are on
        return [readmodel.public(r, now) for r in rows[-limit:]]

    @app.get("/v1/jobs/{job_id}", summary="One job's status", response_model=JobStatus)
    async def get_job(who: Caller, job_id: str) -> dict[str, Any]:
        return readmodel.public(await _visible_job(ctx, who, job_id), ctx.rt().clock.now())

    @app.get("/v1/jobs/{job_id}/explain", summary="Why a job waits, where it stands, when it should start",
             response_model=Explanation)
    async def explain(who: Caller, job_id: str) -> dict[str, Any]:
        row = await _visible_job(ctx, who, job_id)
        return {"job_id": job_id, "state": row["state"],
                "lines": readmodel.explain_lines(row, ctx.rt().clock.now())}


def _add_job_request_routes(app: FastAPI, ctx: ApiContext) -> None:
    """Requests about one job: cancel (its team, or an admin) and approve (an admin)."""

    @app.post("/v1/jobs/{job_id}/cancel", status_code=202, summary="Cancel a job of the token's team (any: admin)",
              response_model=JobRequestSent)
    async def cancel(who: Caller, job_id: str, body: CancelBody | None = None) -> dict[str, str]:
        rows = await readmodel.fetch_status(ctx.database_url, job_id)
        if not rows and who.admin:
            raise HTTPException(404, f"no job {job_id!r}")
        # A job not known yet is cancelled for the caller's team: a tombstone that only that team's job meets.
        # Another team's job is answered the same way, as its status and explanation are (not found to the caller),
        # so that nothing here tells an unknown id from another team's job: the request goes on the caller's team's
        # subject, where admission refuses it for that job (audited) and the job runs on.
        team = rows[0]["team"] if rows and who.may_see(rows[0]["team"]) else who.team
        assert team is not None
        async with ctx.rt().transaction() as tx:
            event = await tx.emit(JobCancelRequested(job_id=job_id, requested_by=who.actor,
                                                     reason=body.reason if body else "",
                                                     requested_at=utcnow_from(tx.now)), subject_suffix=team)
            await audit.record(tx, "cancel_request", who.actor, job_id=job_id, team=team, event_id=event.id)
        return {"job_id": job_id, "event_id": event.id, "status": "cancel requested"}

    @app.post("/v1/jobs/{job_id}/approve", status_code=202, summary="Approve a job awaiting approval (admin)",
              response_model=JobRequestSent)
    async def approve(who: Caller, job_id: str) -> dict[str, str]:
        _admin_only(who)
        row = await _visible_job(ctx, who, job_id)
        if row.get("reason") != governance.AWAITING_APPROVAL:
            raise HTTPException(409, f"job {job_id} is not awaiting approval ({row['state']})")
        async with ctx.rt().transaction() as tx:
            event = await tx.emit(JobApproved(job_id=job_id, approved_by=who.name, approved_at=utcnow_from(tx.now)))
            await audit.record(tx, "approve_request", who.actor, job_id=job_id, team=row["team"], event_id=event.id)
        return {"job_id": job_id, "event_id": event.id, "status": "approval sent"}


def _add_queue_routes(app: FastAPI, ctx: ApiContext) -> None:
    """The queues (admission's read model), the GPUs held outside gpuq, and the queue configuration."""

    @app.get("/v1/queues", summary="Per queue: nominal, used, borrowed, lent, pending, running",
             response_model=list[QueueRow])
    async def queues(who: Caller) -> list[dict[str, Any]]:
        # admission's read model (services/admission/queuemodel.py), written in the transaction of each change
        async with ctx.rt().pool.acquire() as conn:
            facts = await queuemodel.queues(conn)
        if facts is None:
            raise HTTPException(503, "admission has no state yet")
        now = time.time()
        return [dict(f.at(now).__dict__) for f in facts]

    @app.get("/v1/queues/held", summary="GPUs pods gpuq does not manage hold on its nodes (what gpuq queues prints)",
             response_model=HeldOutside)
    async def held(who: Caller) -> dict[str, Any]:
        # beside /v1/queues, whose list body its clients read as is: the line `gpuq queues` prints under the table,
        # from the scheduler's node facts (services/scheduler/readmodel.py, `held_outside`)
        async with ctx.rt().pool.acquire() as conn:
            return scheduler_view.held_outside(await scheduler_view.nodes(conn))

    @app.put("/v1/queues/config", status_code=202, summary="Change teams, quotas and policy (admin)",
             response_model=ConfigProposed)
    async def apply_queues(who: Caller, body: ConfigBody) -> dict[str, Any]:
        _admin_only(who)
        try:
            config = parse_queues(body.config, "request body")
        except ConfigError as exc:
            raise HTTPException(422, str(exc)) from None
        content = queues_hash(config)
        async with ctx.rt().pool.acquire() as conn:
            checked = await check_proposal(conn, config)  # admission checks again when it records it
        if checked.refused and not body.force:
            raise HTTPException(409, f"refused: {checked.reason()}")
        async with ctx.rt().transaction() as tx:
            event = await tx.emit(QueueConfigChanged(config=queues_document(config), changed_by=who.actor,
                                                     force=True if body.force else None))
            await audit.record(tx, "config_change_request", who.actor, event_id=event.id,
                               queues=[q.name for q in config.queues], hash=content,
                               force=True if body.force else None)
        # A proposal: admission records it as the next version (GET /v1/queues/config shows it by its hash) unless
        # its content is in force already.
        return {"event_id": event.id, "hash": content, "warnings": config.warnings()}

    @app.get("/v1/queues/config", summary="The queue configuration in force: version, content hash, when, by whom",
             response_model=ConfigInForce, response_model_exclude_none=True)
    async def config_in_force(who: Caller) -> dict[str, Any]:
        async with ctx.rt().pool.acquire() as conn:
            current = await configmodel.in_force(conn)
        if current is None:
            raise HTTPException(503, "admission has recorded no queue configuration yet")
        body: dict[str, Any] = {"version": current.version, "hash": current.hash, "applied_at": current.applied_at,
                                "applied_by": current.applied_by, "source": current.source}
        if who.admin:
            body["config"] = queues_document(current.config)
        return body


def _add_report_routes(app: FastAPI, ctx: ApiContext) -> None:
    """Usage and cost reports (metering)."""

    @app.get("/v1/report", summary="GPU usage and cost of the token's team (every team for an admin)",
             response_model=Report)
    async def report(who: Caller, by: str = "team", since: str | None = None, until: str | None = None,
                     granularity: Granularity = Granularity.TOTAL, team: str | None = None) -> dict[str, Any]:
        from services.metering.report import report_document

        with _report_errors():
            return await report_document(ctx.database_url, by=by, since=since, until=until, granularity=granularity,
                                         team=team if who.admin else who.team, now=datetime.now(UTC))

    @app.get("/v1/report/focus", summary="FinOps FOCUS rows of the token's team's jobs (every team's: admin)",
             response_model=list[FocusRow])
    async def report_focus(who: Caller, since: str | None = None, until: str | None = None,
                           granularity: Granularity = Granularity.DAY,
                           team: str | None = None) -> list[dict[str, Any]]:
        from services.metering.report import focus_document

        with _report_errors():
            return await focus_document(ctx.database_url, since=since, until=until, granularity=granularity,
                                        team=team if who.admin else who.team, now=datetime.now(UTC))

    @app.get("/v1/budgets", summary="GPU-hour budgets: the token's team's (every team's for an admin), with use and "
                                    "forecast in the current period", response_model=list[BudgetStatusOut])
    async def budgets(who: Caller) -> list[BudgetStatusOut]:
        async with ctx.rt().pool.acquire() as conn:
            rows = await budgetmodel.budgets(conn, None if who.admin else who.team)
        return [BudgetStatusOut.of(r) for r in rows if who.admin or r.team == who.team]

class BudgetStatusOut(BaseModel):
    """A team's GPU-hour budget in its current period (metering's read model, metering.v1_budgets)."""

    team: str
    period: str
    period_start: datetime
    period_end: datetime
    budget_gpu_hours: float
    used_gpu_hours: float
    forecast_gpu_hours: float
    used_ratio: float
    warn_at: float
    on_exhausted: str
    state: str  # ok | warning | exhausted
    reported_at: datetime

    @classmethod
    def of(cls, r: budgetmodel.BudgetRow) -> BudgetStatusOut:
        return cls(team=r.team, period=r.period, period_start=r.period_start, period_end=r.period_end,
                   budget_gpu_hours=r.budget_gpu_hours, used_gpu_hours=r.used_gpu_hours,
                   forecast_gpu_hours=r.forecast_gpu_hours, used_ratio=r.used_ratio, warn_at=r.warn_at,
                   on_exhausted=r.on_exhausted, state=r.state, reported_at=r.reported_at)


def _add_webhook_routes(app: FastAPI, ctx: ApiContext) -> None:
    """A team's webhook subscriptions: list, add, remove, rotate the secret, re-enable."""

    @app.get("/v1/webhooks", summary="Webhook subscriptions of the token's team (all: admin)",
             response_model=list[Webhook])
    async def list_webhooks(who: Caller) -> list[dict[str, Any]]:
        async with ctx.rt().pool.acquire() as conn:
            subs = await webhooks.list_subscriptions(conn, None if who.admin else who.team)
        return [{"id": s.id, "url": s.url, "team": s.team, "events": list(s.events), "active": s.active,
                 "created_at": s.created_at.isoformat()} for s in subs]

    @app.post("/v1/webhooks", status_code=201, summary="Subscribe a URL to the team's job events",
              response_model=WebhookCreated)
    async def add_webhook(who: Caller, body: WebhookBody) -> dict[str, Any]:
        from services.telemetry.webhooks.ssrf import AllowList, TargetRefused, resolve_target

        team = body.team if who.admin else who.team
        if not who.admin and body.team not in (None, who.team):
            raise HTTPException(403, f"this token manages team {who.team!r}'s webhooks only")
        try:
            events = webhooks.validate_events(body.events)
            await resolve_target(body.url, AllowList.from_env())
        except TargetRefused as exc:
            raise HTTPException(422, f"refused: {exc}") from None
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        async with ctx.rt().transaction() as tx:
            sub = await webhooks.add_subscription(tx.conn, body.url, team, events)
            await audit.record(tx, "webhook_add", who.actor, team=team, subscription=sub.id, url=sub.url,
                               events=list(sub.events))
        return {"id": sub.id, "url": sub.url, "team": sub.team, "events": list(sub.events), "secret": sub.secret}

    async def own_subscription(conn: asyncpg.Connection, who: Principal, sub_id: str) -> webhooks.Subscription:
        """The caller's team's subscription (any, for an admin); another team's is not found."""
        sub = {s.id: s for s in await webhooks.list_subscriptions(conn, None)}.get(sub_id)
        if sub is None or not (who.admin or sub.team == who.team):
            raise HTTPException(404, f"no subscription {sub_id}")
        return sub

    @app.delete("/v1/webhooks/{sub_id}", summary="Remove a subscription", response_model=WebhookChanged)
    async def remove_webhook(who: Caller, sub_id: str) -> dict[str, str]:
        async with ctx.rt().transaction() as tx:
            sub = await own_subscription(tx.conn, who, sub_id)
            await webhooks.remove_subscription(tx.conn, sub_id)
            await audit.record(tx, "webhook_remove", who.actor, team=sub.team, subscription=sub_id, url=sub.url)
        return {"id": sub_id, "status": "removed"}

    @app.post("/v1/webhooks/{sub_id}/rotate", summary="A new signing secret (the old one also signs for a while)",
              response_model=WebhookRotated)
    async def rotate_webhook(who: Caller, sub_id: str,
                             grace_hours: Annotated[float, Query(ge=0, le=24 * 30)] = 24.0) -> dict[str, Any]:
        async with ctx.rt().transaction() as tx:
            await own_subscription(tx.conn, who, sub_id)
            sub = await webhooks.rotate_secret(tx.conn, sub_id, tx.now, grace_hours * 3600)
            assert sub is not None  # found just above, in this transaction
            until = sub.previous_secret_expires_at
            await audit.record(tx, "webhook_rotate", who.actor, team=sub.team, subscription=sub_id,
                               grace_hours=grace_hours)
        return {"id": sub.id, "secret": sub.secret,
                "previous_secret_valid_until": until.isoformat(timespec="seconds") if until else None}

    @app.post("/v1/webhooks/{sub_id}/enable", summary="Re-enable a subscription its receiver disabled",
              response_model=WebhookChanged)
    async def enable_webhook(who: Caller, sub_id: str) -> dict[str, str]:
        async with ctx.rt().transaction() as tx:
            sub = await own_subscription(tx.conn, who, sub_id)
            await webhooks.enable_subscription(tx.conn, sub_id)
            await audit.record(tx, "webhook_enable", who.actor, team=sub.team, subscription=sub_id)
        return {"id": sub_id, "status": "enabled"}


def _add_audit_routes(app: FastAPI, ctx: ApiContext) -> None:
    """The audit records (the token's team's; every team's for an admin)."""

    @app.get("/v1/audit", summary="Audit records (the token's team's; all for an admin)",
             response_model=list[AuditRecord])
    async def audit_records(who: Caller, since: datetime | None = None, until: datetime | None = None,
                            team: str | None = None, job_id: str | None = None, action: str | None = None,
                            limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> list[dict[str, Any]]:
        async with ctx.rt().pool.acquire() as conn:
            rows = await read_records(conn, since=since, until=until, team=team if who.admin else who.team,
                                      job_id=job_id, action=action, limit=limit)
        return [{**r, "at": r["at"].isoformat()} for r in rows]


def _offline_docs(app: FastAPI) -> None:
    """/docs (Swagger UI) and /redoc from this service's own files: no CDN, no web fonts, no validator badge, no
    favicon from elsewhere (tests/service/security/test_api_docs.py fetches every URL the pages name)."""
    app.mount(DOCS_STATIC_URL, StaticFiles(directory=_docs_assets()), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{DOCS_STATIC_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_STATIC_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_STATIC_URL}/favicon.png",
            oauth2_redirect_url=None,
            # Swagger UI's default asks validator.swagger.io for a badge of the document
            swagger_ui_parameters={"validatorUrl": None})

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{DOCS_STATIC_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{DOCS_STATIC_URL}/favicon.png", with_google_fonts=False)


def _document_submission_body(app: FastAPI) -> None:
    """POST /v1/jobs reads its body itself (see `_json_body`), so FastAPI knows of no body parameter: its schema is
    added to the generated document here."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = generate()
            body, components = job_request_schemas("#/components/schemas/{model}")
            doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
            doc["paths"]["/v1/jobs"]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": body}}}
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the document


@contextlib.contextmanager
def _report_errors() -> Iterator[None]:
    """A report the caller asked wrongly is 422 with the reason; no ledger yet is 503."""
    from services.metering.report import ReportError

    try:
        yield
    except ReportError as exc:
        raise HTTPException(422, str(exc)) from None
    except asyncpg.UndefinedTableError:
        raise HTTPException(503, "no metering ledger here yet") from None


async def _json_body(request: Request) -> Any:
    """The request's JSON, or a 422 that says why not: a body nested deeper than events may be (checked before parsing,
    so a hostile body cannot exhaust the parser's recursion) or one that is not JSON."""
    raw = await request.body()
    if too_deep(raw):
        raise HTTPException(422, f"the body nests deeper than {MAX_DEPTH} levels of arrays and objects")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise HTTPException(422, f"the body is not JSON: {exc}") from None


def _specs_from_body(doc: Any, who: Principal, config: QueuesConfig | None) -> list[JobSpec]:
    items = doc.get("jobs") if isinstance(doc, dict) and "jobs" in doc else doc
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        raise HTTPException(422, "the body is a job spec, a list of them, or {jobs: [...]}")
    if len(items) > 1000:
        raise HTTPException(422, f"at most 1000 jobs in one submission, got {len(items)}")
    try:
        jobs = Submission(jobs=[_with_id(_with_team_and_queue(item, who, config), who.team) for item in items]).jobs
    except ValidationError as exc:
        first = exc.errors()[0]
        raise HTTPException(422, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    return [_with_user(spec, who) for spec in jobs]


def _with_user(spec: JobSpec, who: Principal) -> JobSpec:
    """The job's user is the authenticated caller (the token's name, or the Kubernetes user the API server vouched
    for): per-user limits count it (docs/admission.md, "Per-user limits"). A team's token naming another user is
    refused; an admin may submit on a user's behalf."""
    if not spec.user:
        return spec.model_copy(update={"user": who.name})
    if not who.admin and spec.user != who.name:
        raise HTTPException(403, f"job {spec.job_id} names user {spec.user!r}; this token submits as {who.name!r} only")
    return spec


def _with_team_and_queue(item: Any, who: Principal, config: QueuesConfig | None) -> Any:
    """A spec without `team` is the token's team's; without `queue`, it goes to the team's default queue. A team's
    token naming another team is refused here, before any default is looked up for that team."""
    if not isinstance(item, dict):
        return item
    team = item.get("team")
    if team in (None, "") and who.team is not None:
        item = {**item, "team": who.team}
        team = who.team
    if not who.admin and isinstance(team, str) and team != who.team:
        raise HTTPException(403, f"job {item.get('job_id') or '(no id)'} names team {team!r}; this token submits "
                                 f"for team {who.team!r} only")
    if item.get("queue") in (None, "") and isinstance(team, str) and team:
        item = {**item, "queue": _default_queue(config, team)}
    return item


def _default_queue(config: QueuesConfig | None, team: str) -> str:
    """The queue a team's job goes to when it names none: its first namespace's first queue (the queue a workload of
    that namespace labelled with none is given), else the team's only queue; a 422 that lists them otherwise."""
    if config is None:
        raise HTTPException(422, "queue: required (no queue configuration is known yet to pick team "
                                 f"{team!r}'s default)")
    for mapping in config.namespaces:
        if mapping.team == team:
            return mapping.queues[0]
    mine = [q.name for q in config.queues if team in q.teams]
    usable = mine or [q.name for q in config.queues if not q.teams]
    if len(usable) == 1:
        return usable[0]
    if not usable:
        raise HTTPException(422, f"queue: required, and team {team!r} may use no queue of the configuration")
    raise HTTPException(422, f"queue: required: team {team!r} has no default queue (it has no namespace mapped) "
                             f"and may use {len(usable)}: {', '.join(usable)}")


def _with_id(item: Any, caller_team: str | None) -> Any:
    """A spec without a job_id is given one: qualified with its team (reserved for it) and random (nobody can guess it
    to take it first). Core/identity.py says why."""
    if not isinstance(item, dict) or item.get("job_id") not in (None, ""):
        return item
    team = item.get("team") if isinstance(item.get("team"), str) else caller_team
    if not team:
        return item  # no team to qualify it with: validation says what is missing
    return {**item, "job_id": identity.assigned_id(team, secrets.token_hex(10))}


async def _known_jobs(conn: asyncpg.Connection, job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """Job id -> (team, status) of the jobs that hold these ids."""
    if not await conn.fetchval("SELECT to_regclass('admission.jobs') IS NOT NULL"):
        return {}
    rows = await conn.fetch("SELECT job_id, team, status FROM admission.jobs WHERE job_id = ANY($1::text[])", job_ids)
    return {r["job_id"]: (r["team"], r["status"]) for r in rows}


def _refuse_taken_ids(specs: list[JobSpec], known: dict[str, tuple[str, str]]) -> None:
    """409 for ids the submitting team may not use, in admission's words: another team's id (taken or reserved) is
    refused the same way whatever that team's job is doing, and says nothing of it; the team's own job says its
    status."""
    refusals = []
    for spec in sorted(specs, key=lambda s: s.job_id):
        holder, status = known.get(spec.job_id, (None, None))
        taken = identity.unavailable(spec.job_id, spec.team, holder)
        if taken is not None:
            refusals.append(f"{taken[0]}: {taken[1]}")
        elif status is not None:
            refusals.append(f"{identity.DUPLICATE_JOB_ID}: job id {spec.job_id} was already submitted ({status})")
    if refusals:
        raise HTTPException(409, "; ".join(refusals))


async def _verdicts(ctx: ApiContext, events: list[tuple[str, str]], wait_s: float) -> list[SubmitResult]:
    """Admission's verdict on each submission (queued, rejected and why, ...), waiting up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    found: dict[str, asyncpg.Record] = {}
    while True:
        async with ctx.rt().pool.acquire() as conn:
            if await conn.fetchval("SELECT to_regclass('admission.submissions') IS NOT NULL"):
                for r in await conn.fetch("SELECT event_id, verdict, reason, message FROM admission.submissions "
                                          "WHERE event_id = ANY($1::text[])", [e for _, e in events]):
                    found[r["event_id"]] = r
        if len(found) == len(events) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    out = []
    for job_id, event_id in events:
        r = found.get(event_id)
        out.append(SubmitResult(job_id=job_id, event_id=event_id, verdict=r["verdict"] if r else "accepted",
                                reason=r["reason"] if r else None, message=r["message"] if r else None))
    return out


class _Server(uvicorn.Server):
    """uvicorn inside gpuq's own event loop: the process's signal handling stays gpuq's (`gpuq up`)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ApiService:
    def __init__(self, database_url: str, *, port: int = DEFAULT_PORT, host: str = "0.0.0.0",
                 queues: QueuesConfig | None = None, kubeconfig: Path | None = None,
                 token_review: TokenReviewSettings | None = None):
        """`token_review`: default from the environment (GPUQ_API_TOKEN_REVIEW...); `kubeconfig`: where to send
        TokenReviews (default: the pod's service account)."""
        review = token_review if token_review is not None else TokenReviewSettings.from_env()
        self.ctx = ApiContext(database_url=database_url, queues=queues,
                              reviewer=TokenReviewer(review, kubeconfig) if review.enabled else None)
        self.port = port
        self.host = host
        self.app = create_app(self.ctx)

    def spec(self) -> ServiceSpec:
        return ServiceSpec(name="api", schema="api", migrations=MIGRATIONS, handlers={}, on_start=self._attach,
                           background=(self.serve,))

    async def _attach(self, runtime: ServiceRuntime) -> None:
        self.ctx.runtime = runtime

    async def serve(self, runtime: ServiceRuntime) -> None:
        server = _Server(uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning",
                                        lifespan="off"))
        log.info("API listening on %s:%d%s", self.host, self.port,
                 " (Kubernetes tokens accepted: TokenReview)" if self.ctx.reviewer is not None else "")
        try:
            await server.serve()
        finally:
            if self.ctx.reviewer is not None:
                await self.ctx.reviewer.close()

