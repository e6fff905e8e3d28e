"""The CLI through the API: with GPUQ_API_URL (and GPUQ_TOKEN) set, in the environment or the config file
(cli/runtime.py), users' commands call the API service and see what their token may see. Without it, commands use
the database and the bus directly: that is for platform admins (who hold DATABASE_URL and the admin bus credential).

Plain urllib: every command imports this module, and an HTTP library costs a tenth of a second to import, five
times the API call itself."""

from __future__ import annotations

import json as jsonlib
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import typer

from cli.runtime import ConfigFileError, setting

URL_ENV = "GPUQ_API_URL"
TOKEN_ENV = "GPUQ_TOKEN"
TIMEOUT_S = 60.0


def _error(message: str) -> None:
    typer.echo(f"error: {message}", err=True)


class ApiError(Exception):
    """An answer of 400 or more: its status and the API's `detail`."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail


class ApiClient:
    def __init__(self, base_url: str, token: str):
        self.base_url = base_url.rstrip("/")
        self.token = token

    def request(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None) -> Any:
        """The answer's JSON; ApiError for an answer of 400 or more. The API unreachable ends the command (exit 2,
        one line naming the URL)."""
        query = {k: ("true" if v is True else "false" if v is False else v) for k, v in (params or {}).items()
                 if v is not None}
        url = self.base_url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        body = None
        if json is not None:
            body = jsonlib.dumps(json).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                detail = jsonlib.loads(raw).get("detail", raw.decode(errors="replace"))
            except (ValueError, AttributeError):
                detail = raw.decode(errors="replace")
            raise ApiError(exc.code, _detail_text(detail)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            _error(f"cannot reach the gpuq API at {self.base_url}: {reason}")
            raise typer.Exit(2) from None
        return jsonlib.loads(raw) if raw else None

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """As `request`, an answer of 400 or more ending the command: one line, exit 1."""
        try:
            return self.request(method, path, **kwargs)
        except ApiError as exc:
            _error(f"{exc.status}: {exc.detail}")
            raise typer.Exit(1) from None


def _detail_text(detail: Any) -> str:
    """FastAPI's `detail`: a string, or its validation errors (one `field: problem` each, on one line)."""
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict):
                where = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
                parts.append(f"{where}: {item.get('msg', '')}" if where else str(item.get("msg", "")))
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return " ".join(str(detail).split())


def api() -> ApiClient | None:
    """The API client when GPUQ_API_URL is set (then GPUQ_TOKEN is required), else None (direct, admin mode)."""
    try:
        url, token = setting("api_url"), setting("token")
    except ConfigFileError as exc:
        raise typer.BadParameter(str(exc), param_hint="GPUQ_CONFIG") from None
    if not url:
        return None
    if not token:
        raise typer.BadParameter(f"{URL_ENV} is set but {TOKEN_ENV} is not: ask an admin for a token "
                                 "(`gpuq tokens create`)", param_hint=TOKEN_ENV)
    return ApiClient(url, token)

