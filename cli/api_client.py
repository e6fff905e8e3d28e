"""The CLI through the API: with GPUQ_API_URL (and GPUQ_TOKEN) set, users' commands call the API service and see
what their token may see. Without it, commands use the database and the bus directly: that is for platform admins
(who hold DATABASE_URL and the admin bus credential)."""

from __future__ import annotations

import os
from typing import Any

import httpx
import typer
from rich.console import Console

URL_ENV = "GPUQ_API_URL"
TOKEN_ENV = "GPUQ_TOKEN"
err = Console(stderr=True)


class ApiClient:
    def __init__(self, base_url: str, token: str):
        self.base_url = base_url.rstrip("/")
        self.token = token

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = httpx.request(method, self.base_url + path, headers={"Authorization": f"Bearer {self.token}"},
                                 timeout=60.0, **kwargs)
        except httpx.HTTPError as exc:
            err.print(f"[red]cannot reach the gpuq API at {self.base_url}: {exc}[/]")
            raise typer.Exit(2) from None
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            err.print(f"[red]{resp.status_code}: {detail}[/]")
            raise typer.Exit(1)
        return resp.json()


def api() -> ApiClient | None:
    """The API client when GPUQ_API_URL is set (then GPUQ_TOKEN is required), else None (direct, admin mode)."""
    url = os.environ.get(URL_ENV)
    if not url:
        return None
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise typer.BadParameter(f"{URL_ENV} is set but {TOKEN_ENV} is not: ask an admin for a token "
                                 "(`gpuq tokens create`)", param_hint=TOKEN_ENV)
    return ApiClient(url, token)
