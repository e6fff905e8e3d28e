"""The portal's pages (server-rendered HTML under /ui): sign in with an API token, job templates, my jobs with their
explanations, queues, costs.

Every read and the submission go through the API's own routes, called in-process over ASGI with the signed-in
token as the bearer: the portal sees what that token sees (a team's token its team only) and a submission is
validated, scoped and audited exactly as POST /v1/jobs does it. The portal adds no rule of its own.

Session: the token lives in an HttpOnly, SameSite=Strict cookie (Secure over HTTPS) and is never written into a
page. Every form that changes something carries a CSRF token derived from the session's token (an HMAC: a page
of another site can neither read the cookie nor compute it); the sign-in form, before any session, carries a random
one that must match a cookie of its own (double submit). Pages are sent with a strict Content-Security-Policy and
are not cached. Jinja escapes everything it renders.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import jinja2
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials
from starlette.staticfiles import StaticFiles

from services.api.portal.catalogue import FormError, JobTemplate, load_catalogue, render_spec, spec_yaml
from services.api.tokens import Principal

HERE = Path(__file__).parent
SESSION_COOKIE = "gpuq_portal"
LOGIN_COOKIE = "gpuq_portal_login"
PREFIX = "/ui"
JOBS_SHOWN = 50  # the newest jobs "my jobs" lists, each with its explanation
EXPLAIN_CONCURRENCY = 8
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # not no-referrer: with it, a browser posts forms with `Origin: null`
    "Cache-Control": "no-store",
}

_env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                          undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def _when(ts: float | str | None) -> str:
    """An epoch or ISO time as the pages show it: UTC, to the minute, the zone named."""
    if ts is None or ts == "":
        return "-"
    moment = datetime.fromisoformat(ts) if isinstance(ts, str) else datetime.fromtimestamp(ts, tz=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _gpus(counts: Mapping[str, int] | None) -> str:
    return ", ".join(f"{n} {model}" for model, n in (counts or {}).items()) or "-"


def _changing(line: str) -> bool:
    """An explanation's line that holds a time or a duration (what the screenshot tests mask: it moves with the
    clock); the reason and the position stay in view."""
    return bool(_CHANGING.search(line))


_CHANGING = re.compile(r"\d{4}-\d\d-\d\d|\d\d:\d\d|\bwaited\b|\bexpected start\b|\bin \d|\bago\b")
_env.filters["when"] = _when
_env.filters["gpus"] = _gpus
_env.filters["duration"] = _duration
_env.tests["changing"] = _changing


Authenticate = Callable[[Request, HTTPAuthorizationCredentials], Awaitable[Principal]]


def mount(app: FastAPI, authenticate: Authenticate) -> None:
    """The portal under /ui of the API's app (services/api/app.py), which signs its sessions in by `authenticate`:
    the API's own check, handed down so that this module never imports the API's (which imports this one)."""
    app.state.portal_authenticate = authenticate
    app.include_router(router(), prefix=PREFIX, include_in_schema=False)
    app.mount(f"{PREFIX}/static", StaticFiles(directory=HERE / "static"), name="portal-static")


def csrf_for(token: str) -> str:
    """The session's CSRF token: only a holder of the API token (the cookie nobody else reads) can compute it."""
    return hmac.new(token.encode(), b"gpuq-portal-csrf", hashlib.sha256).hexdigest()


class Session:
    """The signed-in caller: their token (never rendered), who it is, and the API called on their behalf."""

    def __init__(self, request: Request, token: str, who: Principal):
        self.request, self.token, self.who = request, token, who
        self.csrf = csrf_for(token)

    async def api(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The API's route, in-process, with this session's token: its own auth, scoping and validation."""
        transport = httpx.ASGITransport(app=self.request.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gpuq-api", timeout=60) as client:
            return await client.request(method, path, headers={"Authorization": f"Bearer {self.token}"}, **kwargs)

    async def get_json(self, path: str, **params: Any) -> Any:
        r = await self.api("GET", path, params=params)
        if r.status_code >= 400:
            raise _ApiRefused(r)
        return r.json()


class _ApiRefused(Exception):
    def __init__(self, response: httpx.Response):
        super().__init__(response.status_code)
        self.status = response.status_code
        self.detail = _detail(response)


def _detail(r: httpx.Response) -> str:
    try:
        detail = r.json().get("detail")
    except ValueError:
        return r.text[:500]
    return detail if isinstance(detail, str) else str(detail)


async def _principal(request: Request, token: str) -> Principal | str:
    """Who the token is, by the API's own check (gpuq or Kubernetes token); the API's refusal as text if none."""
    authenticate: Authenticate = request.app.state.portal_authenticate  # set by `mount`
    try:
        return await authenticate(request, HTTPAuthorizationCredentials(scheme="Bearer", credentials=token))
    except HTTPException as exc:
        return str(exc.detail)


async def _session(request: Request) -> Session | None:
    token = request.cookies.get(SESSION_COOKIE)
    if not token:
        return None
    who = await _principal(request, token)
    return Session(request, token, who) if isinstance(who, Principal) else None


async def _form(request: Request) -> dict[str, str]:
    """A urlencoded form's fields (the last of each name); the API's body limit bounds what is read."""
    body = (await request.body()).decode("utf-8", errors="replace")
    return {k: v[-1] for k, v in parse_qs(body, keep_blank_values=True).items()}


def _same_origin(request: Request) -> bool:
    """A POST whose browser names its origin must come from this site (SameSite=Strict covers the rest). Behind a
    proxy that rewrites Host, the host the browser asked for is X-Forwarded-Host."""
    origin = request.headers.get("origin")
    host = request.headers.get("x-forwarded-host") or request.headers.get("host")
    return origin is None or urlsplit(origin).netloc == host


def _page(name: str, status: int = 200, **context: Any) -> HTMLResponse:
    html = _env.get_template(name).render(prefix=PREFIX, **{"tab": None, **context})
    return HTMLResponse(html, status_code=status, headers=HEADERS)


def _redirect(path: str) -> RedirectResponse:
    return RedirectResponse(PREFIX + path, status_code=303, headers=HEADERS)


def _secure(request: Request) -> bool:
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"


def router() -> APIRouter:
    # The routes are added in this order (sign-in, jobs and templates, queues and costs): it is the order FastAPI
    # matches them in.
    r = APIRouter()
    _add_sign_in_routes(r)
    _add_job_routes(r, load_catalogue())
    _add_overview_routes(r)
    return r


def _add_sign_in_routes(r: APIRouter) -> None:
    """The home page's redirect, sign-in (a pasted API token, kept in an HttpOnly cookie) and sign-out."""

    @r.get("", response_class=HTMLResponse)
    @r.get("/", response_class=HTMLResponse)
    async def home(request: Request) -> Response:
        return _redirect("/jobs" if await _session(request) else "/login")

    @r.get("/login", response_class=HTMLResponse)
    async def login_form(request: Request) -> Response:
        return _login_page(request)

    @r.post("/login", response_class=HTMLResponse)
    async def login(request: Request) -> Response:
        form = await _form(request)
        expected = request.cookies.get(LOGIN_COOKIE, "")
        if not _same_origin(request) or not expected or not hmac.compare_digest(form.get("csrf", ""), expected):
            return _login_page(request, "the sign-in form expired: please sign in again", status=403)
        token = form.get("token", "").strip()
        if not token:
            return _login_page(request, "paste an API token (gpuq tokens create issues them)", status=400)
        who = await _principal(request, token)
        if not isinstance(who, Principal):
            return _login_page(request, f"not signed in: {who}", status=401)
        response = _redirect("/jobs")
        response.set_cookie(SESSION_COOKIE, token, httponly=True, samesite="strict", secure=_secure(request),
                            path=PREFIX)
        response.delete_cookie(LOGIN_COOKIE, path=PREFIX)
        return response

    @r.post("/logout", response_class=HTMLResponse)
    async def logout(request: Request) -> Response:
        s = await _session(request)
        form = await _form(request)
        if s is not None and (not _same_origin(request) or not hmac.compare_digest(form.get("csrf", ""), s.csrf)):
            return _page("error.html", 403, s=s, message="this form expired: reload the page and try again")
        response = _redirect("/login")
        response.delete_cookie(SESSION_COOKIE, path=PREFIX)
        return response



def _add_job_routes(r: APIRouter, catalogue: Mapping[str, JobTemplate]) -> None:
    """The team's jobs (each with the API's explanation) and the job templates: their forms and submission."""

    @r.get("/jobs", response_class=HTMLResponse)
    async def jobs(request: Request) -> Response:
        s = await _session(request)
        if s is None:
            return _redirect("/login")
        try:
            rows = (await s.get_json("/v1/jobs", all="true", limit=JOBS_SHOWN))[::-1]  # newest first
            # one explain call per job (the API's words for each), a few at a time: each reads its own connection
            gate = asyncio.Semaphore(EXPLAIN_CONCURRENCY)

            async def explain(row: dict[str, Any]) -> None:
                async with gate:
                    row["explain"] = (await s.get_json(f"/v1/jobs/{row['job_id']}/explain"))["lines"]

            await asyncio.gather(*(explain(row) for row in rows))
        except _ApiRefused as exc:
            return _page("error.html", exc.status, s=s, message=exc.detail)
        return _page("jobs.html", s=s, jobs=rows, tab="jobs")

    @r.get("/templates", response_class=HTMLResponse)
    async def templates(request: Request) -> Response:
        s = await _session(request)
        if s is None:
            return _redirect("/login")
        return _page("templates.html", s=s, templates=list(catalogue.values()), tab="templates")

    @r.get("/templates/{slug}", response_class=HTMLResponse)
    async def template_form(request: Request, slug: str) -> Response:
        s = await _session(request)
        if s is None:
            return _redirect("/login")
        template = catalogue.get(slug)
        if template is None:
            return _page("error.html", 404, s=s, message=f"no job template {slug!r}")
        return await _template_page(s, template, template.defaults())

    @r.post("/templates/{slug}", response_class=HTMLResponse)
    async def template_submit(request: Request, slug: str) -> Response:
        s = await _session(request)
        if s is None:
            return _redirect("/login")
        form = await _form(request)
        if not _same_origin(request) or not hmac.compare_digest(form.get("csrf", ""), s.csrf):
            return _page("error.html", 403, s=s, message="this form expired: reload the page and try again")
        template = catalogue.get(slug)
        if template is None:
            return _page("error.html", 404, s=s, message=f"no job template {slug!r}")
        if form.get("action") != "submit":
            return await _template_page(s, template, form)
        try:
            spec = _spec(s, template, form)
        except FormError as exc:
            return await _template_page(s, template, form, error=str(exc), status=422)
        # the API's own route: its validation, its team scoping, its audit record, admission's verdict
        r = await s.api("POST", "/v1/jobs", json=spec)
        if r.status_code >= 400:
            return await _template_page(s, template, form, error=_detail(r), status=r.status_code)
        return _page("submitted.html", s=s, results=r.json(), template=template, tab="templates")



def _add_overview_routes(r: APIRouter) -> None:
    """The queues and the cost report, as the API shows them to the session's token."""

    @r.get("/queues", response_class=HTMLResponse)
    async def queues(request: Request) -> Response:
        s = await _session(request)
        if s is None:
            return _redirect("/login")
        try:
            rows = await s.get_json("/v1/queues")
        except _ApiRefused as exc:
            return _page("error.html", exc.status, s=s, message=exc.detail, tab="queues")
        return _page("queues.html", s=s, queues=rows, tab="queues")

    @r.get("/costs", response_class=HTMLResponse)
    async def costs(request: Request) -> Response:
        s = await _session(request)
        if s is None:
            return _redirect("/login")
        by = "team,queue" if s.who.admin else "queue"
        try:
            report = await s.get_json("/v1/report", by=by)
        except _ApiRefused as exc:
            return _page("error.html", exc.status, s=s, message=exc.detail, tab="costs")
        return _page("costs.html", s=s, report=report, tab="costs")



def _login_page(request: Request, error: str | None = None, status: int = 200) -> Response:
    nonce = request.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(24)
    response = _page("login.html", status, s=None, csrf=nonce, error=error)
    response.set_cookie(LOGIN_COOKIE, nonce, httponly=True, samesite="strict", secure=_secure(request), path=PREFIX)
    return response


def _spec(s: Session, template: JobTemplate, form: Mapping[str, str]) -> dict[str, Any]:
    """The filled template as a job spec: the token's team (an admin names one), the queue chosen."""
    team = s.who.team if s.who.team is not None else form.get("team", "").strip()
    if not team:
        raise FormError("Team: required (an admin's token submits for the team named here)")
    queue = form.get("queue", "").strip()
    if not queue:
        raise FormError("Queue: required")
    return render_spec(template, form, team=team, queue=queue)


async def _template_page(s: Session, template: JobTemplate, form: Mapping[str, str], *, error: str | None = None,
                         status: int = 200) -> Response:
    """The form, filled as `form` says, beside the YAML it would submit (or what is wrong with it)."""
    try:
        summaries = await s.get_json("/v1/queues")
    except _ApiRefused:
        summaries = []  # no admission state yet: the form still works, the API's verdict says the rest
    queue_names = [q["queue"] for q in summaries]
    models = sorted({m for q in summaries for m in q.get("nominal", {})})
    values = {**template.defaults(), **{k: v for k, v in form.items() if k not in ("csrf", "action")}}
    own = s.who.team if s.who.team in queue_names else None
    values.setdefault("queue", own or (queue_names[0] if queue_names else ""))
    values.setdefault("team", s.who.team or "")
    preview, problem = None, error
    try:
        preview = spec_yaml(_spec(s, template, values))
    except FormError as exc:
        problem = problem or str(exc)
    return _page("template.html", status, s=s, template=template, values=values, queues=queue_names, models=models,
                 preview=preview, error=problem, tab="templates")
