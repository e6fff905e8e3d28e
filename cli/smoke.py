"""`gpuq smoke`: a first job through the API, end to end, then nothing left behind. What `helm test` runs
(deploy/helm/gpuq/templates/tests/smoke.yaml), and what an admin can run after any change.

1. A token: GPUQ_TOKEN when given (a team's, the admin's to manage); otherwise one minted for this run with the
   database (DATABASE_URL, as `gpuq tokens create`): a team token (never an admin's) named `smoke-<random>` that
   expires when the run's time is up, whatever happens to this process.
2. A 1-GPU job submitted through the API as that token, as a user's would be: on the Kubernetes executor it runs
   a pod of `--image` (sleeping) in the team's namespace.
3. Its state read through the API until it is admitted (quota granted) or placed (GPUs chosen on a node), as
   `--wait-for` says: `placed` on a cluster with GPUs, `admitted` on one without. Refused, failed, or not there in
   `--timeout` seconds: the run fails, saying what it saw (`gpuq explain`'s lines).
4. Cleanup whatever happened: the job cancelled (and its end seen), the minted token revoked.

Exit status: 0 when the job got there and everything was cleaned up; 1 otherwise; 2 on bad usage.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import typer
from rich.console import Console

from cli.admin import with_api_db
from cli.api_client import TOKEN_ENV, URL_ENV, ApiClient
from services.api import tokens as api_tokens

console = Console(stderr=True, soft_wrap=True)

# What counts as there for each --wait-for (a placed job may already run or even have ended), and as a failure.
REACHED = {"admitted": ("admitted", "placed", "running", "completed"), "placed": ("placed", "running", "completed")}
ENDED = ("completed", "failed", "cancelled", "rejected")
CLEANUP_S = 60.0  # how long the cancellation may take to be seen (also the minted token's margin past --timeout)


class SmokeFailed(Exception):
    """The run did not get its job where it asked (the message says what it saw)."""


def smoke(
    api_url: str = typer.Option(..., "--api-url", envvar=URL_ENV, help="The gpuq API, e.g. http://gpuq-api:8000"),
    team: str = typer.Option("default", help="The team the job is submitted for (a team token's team)"),
    queue: str | None = typer.Option(None, help="The queue (default: the team's name)"),
    wait_for: str = typer.Option("placed", "--wait-for", help="placed (GPUs chosen: a cluster with GPUs) or "
                                 "admitted (quota granted: enough on a cluster without GPUs)"),
    timeout: float = typer.Option(180.0, help="Seconds the job may take to get there"),
    gpu_model: list[str] = typer.Option([], "--gpu-model", help="Acceptable GPU model (repeat; default: any)"),
    priority: str = typer.Option("normal", help="The job's priority class"),
    image: str | None = typer.Option(None, help="Image of the job's pod on the Kubernetes executor (it sleeps "
                                     "until cancelled: `sleep` must be in it); none: a job without a pod template "
                                     "(the simulated executor's kind)"),
    poll: float = typer.Option(2.0, help="Seconds between two reads of the job's state"),
    label: list[str] = typer.Option([], help="key=value label on the job (repeatable)"),
) -> None:
    """Submit a 1-GPU job through the API with a token made for it, wait until it is admitted or placed, then cancel
    it and revoke the token (what `helm test` runs)."""
    if wait_for not in REACHED:
        raise typer.BadParameter(f"{wait_for!r}: placed or admitted", param_hint="--wait-for")
    if timeout <= 0 or poll <= 0:
        raise typer.BadParameter("--timeout and --poll must be positive")
    started = time.monotonic()
    token, minted = os.environ.get(TOKEN_ENV) or None, None
    if token is None:
        minted = _mint(team, timeout)
        token = minted.token
        console.print(f"smoke: token {minted.id} ({minted.name}, team {team}) minted for this run")
    client = ApiClient(api_url, token)
    job_id: str | None = None
    failure: str | None = None
    try:
        labels = dict(item.split("=", 1) for item in label if "=" in item)
        job_id, verdict = _submit(client, _spec(team, queue or team, priority, gpu_model, image, timeout, labels))
        if verdict["verdict"] in ("rejected", "cancelled", "awaiting_approval"):
            raise SmokeFailed(f"{job_id} was {verdict['verdict']}: {verdict.get('reason')} "
                              f"{verdict.get('message') or ''}")
        _wait(client, job_id, REACHED[wait_for], started + timeout, poll, started)
    except SmokeFailed as exc:
        failure = str(exc)
    except typer.Exit:  # the API client said what went wrong
        failure = "the API refused or could not be reached (above)"
    finally:
        clean = _cleanup(client, job_id, minted, poll)
    if failure is not None:
        console.print(f"[red]smoke: FAILED[/]: {failure}")
        raise typer.Exit(1)
    if not clean:
        console.print("[red]smoke: FAILED[/]: the job got there, but the cleanup did not finish (above)")
        raise typer.Exit(1)
    console.print(f"smoke: passed in {time.monotonic() - started:.1f} s")


def _mint(team: str, timeout: float) -> api_tokens.IssuedToken:
    """A team token for this run only, expiring when its time (and the cleanup's) is up."""
    if not os.environ.get("DATABASE_URL"):
        raise typer.BadParameter(f"set {TOKEN_ENV} (a token of team {team}) or DATABASE_URL (to mint one)",
                                 param_hint=TOKEN_ENV)
    expires = datetime.now(UTC) + timedelta(seconds=timeout + 2 * CLEANUP_S)
    name = f"smoke-{secrets.token_hex(4)}"
    issued: api_tokens.IssuedToken = asyncio.run(with_api_db(
        lambda c: api_tokens.issue(c, name, team=team, expires_at=expires)))
    return issued


def _spec(team: str, queue: str, priority: str, models: list[str], image: str | None, timeout: float,
          labels: dict[str, str]) -> dict[str, Any]:
    """One pod, one GPU, small CPU and memory; no job id (the API gives one reserved for the team)."""
    pod_set: dict[str, Any] = {"count": 1, "gpus_per_pod": 1, "gpu_models": models, "cpu_milli": 100,
                               "memory_mib": 256}
    if image:
        pod_set["template"] = {"image": image, "command": ["sleep", str(int(timeout + 2 * CLEANUP_S))]}
    return {"team": team, "queue": queue, "priority_class": priority, "max_runtime_s": int(timeout + 2 * CLEANUP_S),
            "labels": {"purpose": "smoke-test", **labels}, "pod_sets": [pod_set]}


def _submit(client: ApiClient, spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The job's id and admission's verdict on it (services/api/app.py, SubmitResult)."""
    (result,) = client.call("POST", "/v1/jobs", json=spec)
    job_id: str = result["job_id"]
    console.print(f"smoke: submitted {job_id} (admission's verdict: {result['verdict']})")
    return job_id, result


def _wait(client: ApiClient, job_id: str, reached: tuple[str, ...], deadline: float, poll: float,
          started: float) -> None:
    seen: list[str] = []
    while True:
        state = client.call("GET", f"/v1/jobs/{job_id}")["state"]
        if not seen or seen[-1] != state:
            seen.append(state)
            console.print(f"smoke: {job_id} {state} after {time.monotonic() - started:.1f} s")
        if state in reached:
            return
        if state in ENDED or time.monotonic() >= deadline:
            why = "; ".join(client.call("GET", f"/v1/jobs/{job_id}/explain")["lines"])
            ending = f"it ended {state}" if state in ENDED else f"not {reached[0]} in time"
            raise SmokeFailed(f"{job_id} {ending} (states seen: {' -> '.join(seen)}). {why}")
        time.sleep(poll)


def _cleanup(client: ApiClient, job_id: str | None, minted: api_tokens.IssuedToken | None, poll: float) -> bool:
    """Cancel the job and see it end, revoke the minted token; each tried whatever the other did."""
    clean = True
    if job_id is not None:
        clean = _attempt("cancel the job", lambda: _cancel(client, job_id, poll))
    if minted is not None:
        clean = _attempt("revoke the token", lambda: _revoke(minted)) and clean
    return clean


def _attempt(what: str, step: Callable[[], None]) -> bool:
    try:
        step()
    except Exception as exc:  # (typer.Exit too) the cleanup's other step still runs; the run fails saying so
        console.print(f"[red]smoke: could not {what}[/]: {str(exc) or type(exc).__name__}")
        return False
    return True


def _cancel(client: ApiClient, job_id: str, poll: float) -> None:
    client.call("POST", f"/v1/jobs/{job_id}/cancel", json={"reason": "smoke test done"})
    deadline = time.monotonic() + CLEANUP_S
    while (state := client.call("GET", f"/v1/jobs/{job_id}")["state"]) not in ENDED:
        if time.monotonic() >= deadline:
            raise SmokeFailed(f"{job_id} is still {state} {CLEANUP_S:.0f} s after its cancellation")
        time.sleep(poll)
    console.print(f"smoke: {job_id} {state}")


def _revoke(minted: api_tokens.IssuedToken) -> None:
    if not asyncio.run(with_api_db(lambda c: api_tokens.revoke(c, minted.id))):
        raise SmokeFailed(f"token {minted.id} was not active any more")
    console.print(f"smoke: token {minted.id} revoked")
