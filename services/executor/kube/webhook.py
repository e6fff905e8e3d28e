"""gpuq's admission webhook: an HTTPS server the API server calls before it stores a workload or a pod in a managed
namespace (docs/kubernetes.md, "Admission webhook"). The decisions are core/admission.py's; this is the shell.

It serves `POST /mutate` and `POST /validate` (AdmissionReview v1) and `GET /healthz`, in the Kubernetes executor's
process (`gpuq up --executor kube` with GPUQ_WEBHOOK_PORT set; the chart's `webhook.enabled`). Its certificate is
cert-manager's (mounted at `cert_dir`; cert-manager's CA injector fills the caBundle) or gpuq's own (certs.py): a
self-signed CA kept in the Secret `secret`, written into the `caBundle` of the webhook configurations named
`configurations` at start and whenever it is replaced, `renew_before` its expiry."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import ssl
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.core.kube.admission import Answer, Review, WebhookPolicy, mutate, response, validate
from services.executor.kube import certs
from services.executor.kube.client import (
    MUTATING_WEBHOOKS,
    SECRET,
    VALIDATING_WEBHOOKS,
    KubeApi,
    status_code,
)
from shared.config import QueuesConfig
from shared.settings import settings

log = logging.getLogger("gpuq.executor.webhook")
PORT_ENV = "GPUQ_WEBHOOK_PORT"


@dataclass
class WebhookSettings:
    port: int = 9443  # 0: any free port (tests)
    bind: str = "0.0.0.0"
    service: str = "gpuq-webhook"  # the Service the configurations name (its DNS names go into the certificate)
    namespace: str = "gpuq-system"  # where the Service and the Secret are
    secret: str = "gpuq-webhook-tls"
    # The MutatingWebhookConfiguration and ValidatingWebhookConfiguration (one name for both) whose caBundle gpuq
    # keeps current; empty: none (cert-manager's CA injector does it).
    configurations: tuple[str, ...] = ("gpuq",)
    cert_dir: Path | None = None  # cert-manager: tls.crt and tls.key mounted here; gpuq makes no certificate
    hosts: tuple[str, ...] = ()  # more names or addresses for the certificate (a `url` client configuration)
    # gpuq's own identity (its ServiceAccount's username): requests from it are allowed as they are.
    trusted_users: tuple[str, ...] = ()
    validity: dt.timedelta = certs.DEFAULT_VALIDITY
    renew_before: dt.timedelta = certs.DEFAULT_RENEW_BEFORE
    check_every_s: float = 3600.0  # how often the certificate's expiry is looked at
    now: Callable[[], dt.datetime] = field(default=lambda: dt.datetime.now(dt.UTC))

    @staticmethod
    def from_env(env: Mapping[str, str] = os.environ) -> WebhookSettings | None:
        """From GPUQ_WEBHOOK_* (the chart sets them); None when GPUQ_WEBHOOK_PORT is unset (no webhook)."""
        given = settings(env)
        if given.webhook_port is None:
            return None
        return WebhookSettings(
            port=given.webhook_port, bind=given.webhook_bind, service=given.webhook_service,
            namespace=given.webhook_namespace, secret=given.webhook_secret,
            configurations=given.webhook_configurations, cert_dir=given.webhook_cert_dir, hosts=given.webhook_hosts,
            trusted_users=given.webhook_trusted_users,
            renew_before=dt.timedelta(days=given.webhook_renew_before_days))

    @property
    def all_hosts(self) -> list[str]:
        return [*certs.service_hosts(self.service, self.namespace), *self.hosts]


class _Server(uvicorn.Server):
    """uvicorn inside gpuq's own event loop: the process's signal handling stays gpuq's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class WebhookServer:
    def __init__(self, settings: WebhookSettings, queues: QueuesConfig, api: KubeApi):
        self.settings = settings
        self.policy = WebhookPolicy(queues=queues, trusted_users=frozenset(settings.trusted_users))
        self.api = api
        self.pair: certs.CertPair | None = None
        self.ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ssl.minimum_version = ssl.TLSVersion.TLSv1_2
        self.started = asyncio.Event()
        self.port: int | None = None
        self.app = self._app()

    def _app(self) -> FastAPI:
        app = FastAPI(title="gpuq admission webhook", openapi_url=None, docs_url=None, redoc_url=None)

        async def review(request: Request, decide: Callable[[Review, WebhookPolicy], Answer]) -> JSONResponse:
            try:
                parsed = Review.parse(json.loads(await request.body()))
            except ValueError as exc:
                return JSONResponse({"error": f"bad AdmissionReview: {exc}"}, status_code=400)
            answer = decide(parsed, self.policy)
            if not answer.allowed:
                log.info("refused %s %s %s/%s by %s: %s", parsed.operation, parsed.kind, parsed.namespace,
                         (parsed.obj.get("metadata") or {}).get("name"), parsed.user, answer.message)
            return JSONResponse(response(parsed.uid, answer))

        @app.post("/mutate")
        async def mutate_endpoint(request: Request) -> JSONResponse:
            return await review(request, mutate)

        @app.post("/validate")
        async def validate_endpoint(request: Request) -> JSONResponse:
            return await review(request, validate)

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "ok"}

        return app

    # ------------------------------------------------------------------ certificates

    def _load(self, cert_pem: bytes, key_pem: bytes) -> None:
        """Serve this pair from now on (new connections; load_cert_chain reads files)."""
        with tempfile.TemporaryDirectory(prefix="gpuq-webhook-") as tmp:
            cert_file, key_file = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
            cert_file.write_bytes(cert_pem)
            key_file.touch(mode=0o600)
            key_file.write_bytes(key_pem)
            self.ssl.load_cert_chain(cert_file, key_file)

    async def ensure_certificate(self) -> None:
        """The serving pair: cert-manager's files, or the Secret's when still good, or a new one (stored, and its
        CA published in the configurations' caBundle, with the CA it replaces beside it until the next one)."""
        s = self.settings
        if s.cert_dir is not None:
            self._load((s.cert_dir / "tls.crt").read_bytes(), (s.cert_dir / "tls.key").read_bytes())
            return
        secret = await self._get_secret()
        pair = certs.CertPair.from_secret(secret) if secret is not None else None
        previous_ca = pair.ca_pem if pair is not None else b""
        if pair is None or pair.due(s.now(), s.renew_before, s.all_hosts):
            pair = certs.generate(s.all_hosts, s.now(), s.validity)
            await self._store(secret, pair)
            log.info("webhook certificate made for %s, valid until %s", ", ".join(s.all_hosts), pair.not_after)
        bundle = pair.ca_pem + (previous_ca if previous_ca and previous_ca != pair.ca_pem else b"")
        await self.publish_ca(bundle)  # before serving with it: the API server must trust it first
        self._load(pair.cert_pem, pair.key_pem)
        self.pair = pair

    async def _get_secret(self) -> dict[str, Any] | None:
        try:
            return await self.api.get(SECRET, self.settings.secret, namespace=self.settings.namespace)
        except Exception as exc:
            if status_code(exc) == 404:
                return None
            raise

    async def _store(self, existing: dict[str, Any] | None, pair: certs.CertPair) -> None:
        s = self.settings
        if existing is None:
            await self.api.create(SECRET, {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                                           "metadata": {"name": s.secret, "namespace": s.namespace,
                                                        "labels": {"app.kubernetes.io/part-of": "gpuq"}},
                                           "data": pair.secret_data()}, namespace=s.namespace)
        else:
            await self.api.patch(SECRET, s.secret, {"data": pair.secret_data()}, namespace=s.namespace)

    async def publish_ca(self, bundle: bytes) -> None:
        """Write `bundle` into the caBundle of every webhook of the configurations (a missing one is skipped)."""
        import base64

        encoded = base64.b64encode(bundle).decode()
        for name in self.settings.configurations:
            for res in (MUTATING_WEBHOOKS, VALIDATING_WEBHOOKS):
                try:
                    config = await self.api.get(res, name)
                except Exception as exc:
                    if status_code(exc) == 404:
                        log.warning("webhook configuration %s %s not found: its caBundle is not set", res.__name__,
                                    name)
                        continue
                    raise
                webhooks = [dict(w) for w in config.get("webhooks") or []]
                if all((w.get("clientConfig") or {}).get("caBundle") == encoded for w in webhooks):
                    continue
                for w in webhooks:
                    w["clientConfig"] = {**(w.get("clientConfig") or {}), "caBundle": encoded}
                await self.api.patch(res, name, {"webhooks": webhooks})

    async def rotate_if_due(self) -> bool:
        """Replace the certificate when it is due (self-signed mode); whether it was replaced."""
        s = self.settings
        if s.cert_dir is not None:  # cert-manager renews the files; read them again
            await self.ensure_certificate()
            return False
        if self.pair is not None and not self.pair.due(s.now(), s.renew_before, s.all_hosts):
            return False
        await self.ensure_certificate()
        return True

    # ------------------------------------------------------------------ serving

    async def serve(self, runtime: object = None) -> None:
        """Serve until cancelled; the certificate is made (or read) first, then looked at every check_every_s."""
        while True:
            try:
                await self.ensure_certificate()
                break
            except Exception as exc:
                log.warning("webhook: could not set up its certificate (retrying in 5 s): %s", exc)
                await asyncio.sleep(5)
        config = uvicorn.Config(self.app, host=self.settings.bind, port=self.settings.port, log_level="warning",
                                lifespan="off")
        config.load()
        config.ssl = self.ssl  # ours, so that a rotation reaches new connections without a restart
        server = _Server(config)
        task = asyncio.create_task(server.serve(), name="gpuq-webhook")
        try:
            while not server.started:
                if task.done():
                    await task
                    raise RuntimeError("the webhook server stopped before it started")
                await asyncio.sleep(0.02)
            self.port = server.servers[0].sockets[0].getsockname()[1]
            log.info("admission webhook listening on https://%s:%d", self.settings.bind, self.port)
            self.started.set()
            while True:
                await asyncio.sleep(self.settings.check_every_s)
                try:
                    await self.rotate_if_due()
                except Exception as exc:
                    log.warning("webhook: certificate check failed (retrying at the next check): %s", exc)
        finally:
            self.started.clear()
            server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 5)
            task.cancel()
