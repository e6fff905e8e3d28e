"""gpuq's producer SDK: submit jobs, read their status, wait for them, cancel them and ask why they wait, from a
pipeline (Airflow, Kubeflow, a script), synchronously (`Client`) or with asyncio (`AsyncClient`).

    from gpuq_sdk import Client

    with Client() as gpuq:                        # GPUQ_API_URL and GPUQ_TOKEN (a team's token)
        job = gpuq.submit(gpus=8, max_runtime_s=3600, labels={"project": "llm"})
        final = gpuq.wait(job.job_id, timeout_s=6 * 3600)
        print(final["state"])                     # completed | failed | cancelled | rejected

Over the API (the default), the token decides the team, and a job naming no queue goes to the team's default queue.
Over the bus (`nats_url=`: a team's NATS credential), `submit` and `cancel` publish JobSubmitted and
JobCancelRequested on the team's subjects, as the CLI's admin mode does, and answer without waiting for admission;
`status`, `wait` and `explain` always read the API. The bus needs the team and the queue named, and gpuq itself
installed (`pip install gpuq`); the API needs only httpx.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import httpx

__all__ = ["TERMINAL_STATES", "AsyncClient", "Client", "GpuqError", "SubmissionRefused", "Submitted", "WaitTimeout"]

URL_ENV = "GPUQ_API_URL"
TOKEN_ENV = "GPUQ_TOKEN"
NATS_ENV = "GPUQ_NATS_URL"
TERMINAL_STATES = frozenset({"completed", "failed", "cancelled", "rejected"})
SOURCE = "gpuq-sdk"


class GpuqError(RuntimeError):
    """The API refused a call (`status_code` and its `detail`), or it could not be reached (`status_code` None)."""

    def __init__(self, message: str, status_code: int | None = None, detail: Any = None):
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail


class SubmissionRefused(GpuqError):
    """Admission rejected the job: `result` holds its reason and message."""

    def __init__(self, result: Submitted):
        super().__init__(f"job {result.job_id} refused: {result.reason}: {result.message}", detail=result)
        self.result = result


class WaitTimeout(GpuqError, TimeoutError):
    """The job did not end in time; `last` is the status last read."""

    def __init__(self, job_id: str, timeout_s: float, last: dict[str, Any]):
        super().__init__(f"job {job_id} still {last.get('state')} after {timeout_s:g} s")
        self.last = last


@dataclass(frozen=True)
class Submitted:
    """Admission's verdict on a submission: queued, awaiting_approval, rejected, cancelled, or accepted (no verdict
    yet: the API waited `verdict_wait_s`, or the job went over the bus)."""

    job_id: str
    verdict: str
    event_id: str
    reason: str | None = None
    message: str | None = None


def job_spec(spec: Mapping[str, Any] | None = None, *, gpus: float | None = None, pods: int | None = None,
             gpu_models: tuple[str, ...] | list[str] = (), queue: str | None = None, team: str | None = None,
             job_id: str | None = None, priority_class: str | None = None, max_runtime_s: int | None = None,
             labels: Mapping[str, str] | None = None, min_pods: int | None = None) -> dict[str, Any]:
    """A job spec as the API takes it: `spec` (a dict as in a job file) with the keyword arguments laid over it; a
    spec with no pod sets gets one pod set of `pods` pods with `gpus` GPUs each (1 and 1 by default). Fields left
    out are the platform's to fill (team, queue, job id) or default (priority class, runtime limit). `gpus` between 0
    and 1 (0.25) asks that part of one GPU, shared with other pods (`gpu_fraction`). `min_pods`: an elastic pod set
    (`min_count`), run with `min_pods`..`pods` pods (docs/scheduler.md, "Elastic jobs")."""
    out: dict[str, Any] = dict(spec or {})
    if "pod_sets" not in out or gpus is not None or pods is not None or gpu_models or min_pods is not None:
        pod_set: dict[str, Any] = {"count": 1 if pods is None else pods, "gpus_per_pod": 1 if gpus is None else gpus}
        if min_pods is not None:
            pod_set["min_count"] = min_pods
        if gpus is not None and 0 < gpus < 1:  # part of one GPU: one shared GPU per pod
            pod_set.update(gpus_per_pod=1, gpu_fraction=gpus)
        if gpu_models:
            pod_set["gpu_models"] = list(gpu_models)
        out["pod_sets"] = [pod_set]
    for key, value in (("queue", queue), ("team", team), ("job_id", job_id), ("priority_class", priority_class),
                       ("max_runtime_s", max_runtime_s)):
        if value is not None:
            out[key] = value
    if labels:
        out["labels"] = {**out.get("labels", {}), **labels}
    return out


def _detail(resp: httpx.Response) -> Any:
    try:
        body = resp.json()
    except ValueError:
        return resp.text
    return body.get("detail", body) if isinstance(body, dict) else body


def _checked(resp: httpx.Response, what: str) -> Any:
    if resp.status_code >= 400:
        detail = _detail(resp)
        raise GpuqError(f"{what}: {resp.status_code}: {detail}", resp.status_code, detail)
    return resp.json()


def _submitted(results: list[dict[str, Any]], check: bool) -> Submitted:
    r = results[0]
    result = Submitted(job_id=r["job_id"], verdict=r["verdict"], event_id=r["event_id"], reason=r.get("reason"),
                       message=r.get("message"))
    if check and result.verdict == "rejected":
        raise SubmissionRefused(result)
    return result


class _Settings:
    def __init__(self, url: str | None, token: str | None, nats_url: str | None):
        self.url = (url or os.environ.get(URL_ENV) or "").rstrip("/")
        self.token = token or os.environ.get(TOKEN_ENV) or ""
        self.nats_url = nats_url or os.environ.get(NATS_ENV) or None
        if not self.url and not self.nats_url:
            raise ValueError(f"no gpuq to talk to: pass url= (or set {URL_ENV}) for the API, or nats_url= (or set "
                             f"{NATS_ENV}) for the bus")
        if self.url and not self.token:
            raise ValueError(f"the API needs a token: pass token= or set {TOKEN_ENV} (`gpuq tokens create`)")

    def api(self, what: str) -> str:
        if not self.url:
            raise ValueError(f"{what} reads the API: pass url= (or set {URL_ENV}) as well as nats_url=")
        return self.url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


class AsyncClient:
    """The SDK with asyncio. `url`/`token`: the API and a token (default GPUQ_API_URL, GPUQ_TOKEN); `nats_url`:
    submit and cancel over the bus instead (default GPUQ_NATS_URL), with that URL's team credential."""

    def __init__(self, url: str | None = None, token: str | None = None, *, nats_url: str | None = None,
                 timeout_s: float = 60.0):
        self._settings = _Settings(url, token, nats_url)
        self._http = httpx.AsyncClient(base_url=self._settings.url or "http://unused", timeout=timeout_s,
                                       headers=self._settings.headers)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, what: str, **kwargs: Any) -> Any:
        self._settings.api(what)
        try:
            resp = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise GpuqError(f"{what}: cannot reach the gpuq API at {self._settings.url}: {exc}") from None
        return _checked(resp, what)

    async def submit(self, spec: Mapping[str, Any] | None = None, *, check: bool = True,
                     verdict_wait_s: float = 5.0, **fields: Any) -> Submitted:
        """Submit one job (`spec` and/or the fields of `job_spec`). Answers admission's verdict; a rejected job
        raises SubmissionRefused unless `check=False`."""
        body = job_spec(spec, **fields)
        if self._settings.nats_url:
            return await _publish_submission(self._settings.nats_url, body)
        results = await self._call("POST", "/v1/jobs", "submit", json=body, params={"wait": verdict_wait_s})
        return _submitted(results, check)

    async def status(self, job_id: str) -> dict[str, Any]:
        """The job's status (`state`: pending, admitted, placed, running, completed, failed, cancelled, rejected)."""
        return dict(await self._call("GET", f"/v1/jobs/{job_id}", f"status of {job_id}"))

    async def explain(self, job_id: str) -> list[str]:
        """Why the job waits, where it stands and when it should start, in lines of words."""
        return list((await self._call("GET", f"/v1/jobs/{job_id}/explain", f"explain {job_id}"))["lines"])

    async def cancel(self, job_id: str, reason: str = "", *, team: str | None = None) -> str:
        """Ask for the job to be cancelled (it shows in its status); answers the request's event id. Over the bus,
        `team` is the job's team (the credential's)."""
        if self._settings.nats_url:
            return await _publish_cancel(self._settings.nats_url, job_id, reason, team)
        body = await self._call("POST", f"/v1/jobs/{job_id}/cancel", f"cancel {job_id}", json={"reason": reason})
        return str(body["event_id"])

    async def wait(self, job_id: str, timeout_s: float = 3600.0, poll_s: float = 2.0) -> dict[str, Any]:
        """Poll the job's status until it ends (completed, failed, cancelled, rejected) and answer that status;
        WaitTimeout after `timeout_s`. A job the API does not know yet (just sent over the bus) is polled on."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {"job_id": job_id, "state": "unknown"}
        while True:
            try:
                last = await self.status(job_id)
            except GpuqError as exc:
                if exc.status_code != 404:
                    raise
            if last.get("state") in TERMINAL_STATES:
                return last
            if time.monotonic() >= deadline:
                raise WaitTimeout(job_id, timeout_s, last)
            await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


class Client:
    """The SDK, synchronous (Airflow tasks, scripts): the same calls as AsyncClient."""

    def __init__(self, url: str | None = None, token: str | None = None, *, nats_url: str | None = None,
                 timeout_s: float = 60.0):
        self._settings = _Settings(url, token, nats_url)
        self._http = httpx.Client(base_url=self._settings.url or "http://unused", timeout=timeout_s,
                                  headers=self._settings.headers)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, what: str, **kwargs: Any) -> Any:
        self._settings.api(what)
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise GpuqError(f"{what}: cannot reach the gpuq API at {self._settings.url}: {exc}") from None
        return _checked(resp, what)

    def submit(self, spec: Mapping[str, Any] | None = None, *, check: bool = True, verdict_wait_s: float = 5.0,
               **fields: Any) -> Submitted:
        """See AsyncClient.submit."""
        body = job_spec(spec, **fields)
        if self._settings.nats_url:
            return asyncio.run(_publish_submission(self._settings.nats_url, body))
        return _submitted(self._call("POST", "/v1/jobs", "submit", json=body, params={"wait": verdict_wait_s}), check)

    def status(self, job_id: str) -> dict[str, Any]:
        """See AsyncClient.status."""
        return dict(self._call("GET", f"/v1/jobs/{job_id}", f"status of {job_id}"))

    def explain(self, job_id: str) -> list[str]:
        """See AsyncClient.explain."""
        return list(self._call("GET", f"/v1/jobs/{job_id}/explain", f"explain {job_id}")["lines"])

    def cancel(self, job_id: str, reason: str = "", *, team: str | None = None) -> str:
        """See AsyncClient.cancel."""
        if self._settings.nats_url:
            return asyncio.run(_publish_cancel(self._settings.nats_url, job_id, reason, team))
        return str(self._call("POST", f"/v1/jobs/{job_id}/cancel", f"cancel {job_id}", json={"reason": reason})
                   ["event_id"])

    def wait(self, job_id: str, timeout_s: float = 3600.0, poll_s: float = 2.0) -> dict[str, Any]:
        """See AsyncClient.wait."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {"job_id": job_id, "state": "unknown"}
        while True:
            try:
                last = self.status(job_id)
            except GpuqError as exc:
                if exc.status_code != 404:
                    raise
            if last.get("state") in TERMINAL_STATES:
                return last
            if time.monotonic() >= deadline:
                raise WaitTimeout(job_id, timeout_s, last)
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


# --- the bus ------------------------------------------------------------------------------------------------------


async def _publish_submission(nats_url: str, body: dict[str, Any]) -> Submitted:
    """JobSubmitted on `<ns>.job.submitted.<team>`: what a team's credential may publish (admission audits it and
    answers with JobQueued or JobRejected, which `status` shows)."""
    from pydantic import ValidationError

    from shared.domain import JobSpec
    from shared.events import JobSubmitted

    missing = [f for f in ("team", "queue") if not body.get(f)]
    if missing:
        raise ValueError(f"over the bus a job names its {' and '.join(missing)} (the API fills them from the token)")
    if not body.get("job_id"):
        body = {**body, "job_id": f"{body['team']}::{secrets.token_hex(10)}"}  # as the API assigns one
    try:
        spec = JobSpec.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"job spec: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    now = datetime.now(timezone.utc)  # noqa: UP017 (as gpuq_sdk/__init__.py: kept for older Pythons)
    payload = JobSubmitted(spec=spec, submitted_at=now, submitted_by=SOURCE)
    event_id = await _publish(nats_url, payload, JobSubmitted.scoped_subject(spec.team), now)
    return Submitted(job_id=spec.job_id, verdict="accepted", event_id=event_id)


async def _publish_cancel(nats_url: str, job_id: str, reason: str, team: str | None) -> str:
    from shared.events import JobCancelRequested

    if not team:
        raise ValueError("over the bus a cancel names the job's team (team=...): its subject is the team's")
    now = datetime.now(timezone.utc)  # noqa: UP017
    payload = JobCancelRequested(job_id=job_id, requested_by=SOURCE, reason=reason, requested_at=now)
    return await _publish(nats_url, payload, JobCancelRequested.scoped_subject(team), now)


async def _publish(nats_url: str, payload: Any, subject: str, now: datetime) -> str:
    from shared.bus import connect
    from shared.events import encode_event
    from shared.tracing import traced_event

    event = traced_event(payload, source=SOURCE, time=now)
    nc = await connect(nats_url, SOURCE)
    try:
        try:
            # acknowledged by JetStream once stored: a credential without the right to this subject gets no ack
            await nc.jetstream().publish(subject, encode_event(event), headers={"Nats-Msg-Id": event.id},
                                         timeout=5.0)
        except TimeoutError:
            raise GpuqError(f"the bus did not store {subject} (is the credential this team's?)") from None
    finally:
        await nc.close()
    return event.id
