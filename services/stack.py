"""Wiring: build the services from configuration and run them (all in one process, or a chosen subset).

`gpuq up`, `make demo` and the system tests all start the platform through `Stack`, so what the tests
exercise is what operators run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg

from services.admission.sharding import cohorts_from_env
from shared import busauth
from shared.busauth import BusAuth
from shared.clock import Clock, SystemClock
from shared.config import ClusterConfig, DcgmSettings, QueuesConfig, dcgm_settings
from shared.db import create_pool
from shared.health import CONFIG_STATE_KEY, ConfigInForce, HealthReport, ServiceHealth, combine
from shared.service import ServiceRuntime, ServiceSpec
from shared.settings import settings as read_settings
from shared.tracing import setup_tracing

if TYPE_CHECKING:
    from services.admission.app import EtaFn

log = logging.getLogger("gpuq.stack")

ALL_SERVICES = ("admission", "scheduler", "preemption", "metering", "telemetry", "executor", "audit", "api")


@dataclass
class StackSettings:
    nats_url: str
    database_url: str
    queues: QueuesConfig
    cluster: ClusterConfig | None = None  # needed by the simulated executor
    cluster_dir: Path | None = None
    # "sim": the simulated cluster of cluster.yaml; "kube": the Kubernetes executor (services/executor/kube), with
    # `kubeconfig` (None = the pod's in-cluster service account), which the API's TokenReview also uses.
    executor: str = "sim"
    kubeconfig: Path | None = None
    services: Sequence[str] = ALL_SERVICES
    clock: Clock = field(default_factory=SystemClock)
    metrics_port: int | None = None  # telemetry's /metrics; None = no HTTP endpoint
    # The address the API and /metrics listen on (`gpuq up --bind`, GPUQ_BIND): this machine only unless a
    # container or the chart opens it to every interface (0.0.0.0).
    bind: str = "127.0.0.1"
    # Telemetry's per-job gauges (`gpuq_job_*`, labelled with job ids): off unless asked (GPUQ_METRICS_JOB_LABELS).
    metrics_job_labels: bool = False
    instance: str = "0"
    api_port: int = 8000  # the API service's HTTP port (GPUQ_API_PORT)
    # Bus credentials per service (shared/natsauth.py): service -> NATS URL; a service not named uses nats_url.
    nats_urls: dict[str, str] = field(default_factory=dict)
    # The cohorts this process's admission instance serves ("-" = queues without a cohort); empty = all cohorts,
    # one instance for everything. Default: GPUQ_ADMISSION_COHORTS (comma separated). docs/admission.md.
    admission_cohorts: Sequence[str] = field(default_factory=cohorts_from_env)
    # Real utilisation from dcgm-exporter via Prometheus for the executor; None = cluster.yaml's `dcgm` section
    # with the GPUQ_DCGM_* environment applied (shared.config.dcgm_settings), absent = synthetic samples.
    dcgm: DcgmSettings | None = None


def build_specs(settings: StackSettings) -> list[ServiceSpec]:
    """The ServiceSpec of every requested service that exists in this build."""
    specs: list[ServiceSpec] = []
    wanted = set(settings.services)
    if "admission" in wanted:
        from services.admission.app import AdmissionService

        specs.append(AdmissionService(settings.queues, eta=_eta_function(), cohorts=settings.admission_cohorts).spec())
    if "scheduler" in wanted:
        from services.scheduler.app import SchedulerService

        specs.append(SchedulerService(queues=settings.queues).spec())
    if "executor" in wanted:
        specs.append(_executor_spec(settings))
    if "api" in wanted:
        from services.api.app import ApiService

        specs.append(ApiService(settings.database_url, port=settings.api_port, host=settings.bind,
                                queues=settings.queues, kubeconfig=settings.kubeconfig).spec())
    for optional in ("preemption", "metering", "telemetry", "audit"):
        if optional in wanted:
            spec = _optional_spec(optional, settings)
            if spec is not None:
                specs.append(spec)
    return specs


def _executor_spec(settings: StackSettings) -> ServiceSpec:
    # Real utilisation and GPU health from dcgm-exporter, for either executor (docs/observability.md).
    dcgm = settings.dcgm or dcgm_settings(settings.cluster, os.environ)
    if settings.executor == "kube":
        from services.executor.kube.app import KubeExecutorSettings, build_executor
        from shared.config import ClusterConfig, ClusterSource

        cluster = settings.cluster or ClusterConfig(source=ClusterSource.KUBERNETES)
        if cluster.source is not ClusterSource.KUBERNETES:
            raise ValueError("the Kubernetes executor reads its nodes from the API: give a cluster.yaml with "
                             "source: kubernetes (or none, for the defaults)")
        return build_executor(KubeExecutorSettings(cluster=cluster, queues=settings.queues, dcgm=dcgm),
                              settings.kubeconfig).spec()
    if settings.executor != "sim":
        raise ValueError(f"unknown executor {settings.executor!r} (sim or kube)")
    if settings.cluster is None:
        raise ValueError("the simulated executor needs a cluster.yaml (--cluster)")
    from services.executor.sim import SimExecutor, SimExecutorSettings

    # Behind the executor's lease, as the Kubernetes executor: a second instance is a hot standby.
    return SimExecutor(SimExecutorSettings(cluster=settings.cluster, cluster_dir=settings.cluster_dir,
                                           dcgm=dcgm, lease=True)).spec()


def _eta_function() -> EtaFn:
    """The forward-simulation ETA with the production cores and predicted durations (services/eta)."""
    from services.core.eta import EtaModel
    from services.eta.platform import PlatformEta

    # (GPUQ_ETA_RANGE_METHOD: the p10 and p90 replays, or the median replay and the record's error quantiles)
    return PlatformEta(EtaModel(range_method=read_settings().eta_range_method))


def _optional_spec(name: str, settings: StackSettings) -> ServiceSpec | None:
    """Services whose app module exposes `build_spec(settings)`; absent ones are reported, not fatal."""
    import importlib

    try:
        module = importlib.import_module(f"services.{name}.app")
    except ImportError as exc:
        log.warning("service %s is not available in this build: %s", name, exc)
        return None
    build = getattr(module, "build_spec", None)
    if build is None:
        log.warning("service %s has no build_spec(settings)", name)
        return None
    spec: ServiceSpec = build(settings)
    return spec


def _with_config(runtime: ServiceRuntime, report: ServiceHealth) -> ServiceHealth:
    """The service's report with the queue configuration version it runs on, when it uses queues.yaml (a service that
    does leaves a callable in its runtime's state once it has loaded it: services/admission/follow.py)."""
    answer = runtime.state.get(CONFIG_STATE_KEY)
    config = answer() if callable(answer) else None
    return report.model_copy(update={"config": config}) if isinstance(config, ConfigInForce) else report


class Stack:
    def __init__(self, settings: StackSettings):
        self.settings = settings
        self.pool: asyncpg.Pool | None = None
        self.runtimes: list[ServiceRuntime] = []
        self.starting: ServiceRuntime | None = None  # the runtime in start-up (a standby waits there)
        self.bus_auth: BusAuth | None = None  # whether the bus takes clients without credentials (found at start)

    async def start(self) -> None:
        setup_tracing("gpuq", exporter=read_settings().trace_exporter)
        # Said at every start, loudly, where an operator looks (the log, /readyz): not a reason to refuse to run.
        self.bus_auth = await busauth.check_and_warn(self.settings.nats_url)
        self.pool = await create_pool(self.settings.database_url, max_size=20)
        try:
            for spec in build_specs(self.settings):
                nats_url = self.settings.nats_urls.get(spec.name, self.settings.nats_url)
                runtime = ServiceRuntime(spec, nats_url=nats_url, pool=self.pool,
                                         clock=self.settings.clock, instance=self.settings.instance,
                                         database_url=self.settings.database_url)
                self.starting = runtime
                await runtime.start()
                self.runtimes.append(runtime)
                self.starting = None
        except BaseException:
            # The runtime that was starting (a standby waiting for its lease, when cancelled) holds connections too.
            starting, self.starting = self.starting, None
            if starting is not None:
                with contextlib.suppress(Exception):
                    await starting.stop()
            await self.stop()
            raise

    def runtime(self, name: str) -> ServiceRuntime:
        for r in self.runtimes:
            if r.spec.name == name:
                return r
        raise KeyError(name)

    async def health(self, *, connections: bool = True) -> HealthReport:
        """The readiness of every service this stack runs, started or not yet (for /healthz and /readyz); the
        services are checked concurrently, so one slow server costs one check timeout, not one per service."""
        runtimes = [*self.runtimes, *([self.starting] if self.starting is not None else [])]
        reports = [_with_config(runtime, report) for runtime, report in zip(runtimes, await asyncio.gather(
            *(runtime.health(connections=connections) for runtime in runtimes)), strict=True)]
        warning = self.bus_auth.warning if self.bus_auth is not None else None
        return combine(reports, expected=self.settings.services,
                       warnings={busauth.WARNING_KEY: warning} if warning else None)

    async def stop(self) -> None:
        for runtime in reversed(self.runtimes):
            with contextlib.suppress(Exception):
                await runtime.stop()
        self.runtimes.clear()
        if self.pool is not None:
            await self.pool.close()
            self.pool = None

    async def __aenter__(self) -> Stack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
