"""`executor/kube`: runs gpuq's decisions on a Kubernetes cluster (docs/kubernetes.md).

It honours the simulated executor's protocol (services/executor/sim.py): JobPlaced -> run; JobStarted,
JobCompleted/JobFailed with reasons; CheckpointRequested -> checkpoint annotation on the pods -> JobCheckpointed
from the SDK's answer -> (preemption service) JobPreempted -> suspend; a resumed job gets GPUQ_RESUME_FROM.
It also feeds the platform: NodeInventory/NodeChanged from the node informer, JobSubmitted from suspended workloads
labelled `gpuq.io/queue`, and Kubernetes Events + the `gpuq.io/status` annotation from the jobs' lifecycle events.
With `dcgm` settings it runs the DCGM source (services/executor/dcgm.py) as a background loop and is its
`ExecutorView`: GPU utilisation samples attributed to its jobs' pods, and GPU faults degrading its nodes.

Every decision is written to Postgres with the events it emits, in one transaction (the runtime's outbox); API
calls are made inside that unit of work, so a failed call rolls the decision back and it is retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path

import asyncpg

from services.core.executor.attribution import Placements
from services.core.kube import dcgm_view
from services.executor import fence
from services.executor.dcgm import DcgmSource, ensure_health_table
from services.executor.heartbeat import Heartbeat
from services.executor.kube.answers import Answers
from services.executor.kube.client import KubeApi
from services.executor.kube.config_in_force import ConfigInForce
from services.executor.kube.interruptions import Interruptions
from services.executor.kube.leadership import Seat
from services.executor.kube.nodes import NodeWatch
from services.executor.kube.notices import Notices
from services.executor.kube.outcomes import Outcomes
from services.executor.kube.plainintake import PlainPodIntake
from services.executor.kube.pods import PodWatch
from services.executor.kube.provisioning import Capacity
from services.executor.kube.records import bindings_of
from services.executor.kube.resizes import Resizes
from services.executor.kube.running import Runner
from services.executor.kube.settings import KubeExecutorSettings
from services.executor.kube.stops import Stops
from services.executor.kube.timers import Timers
from services.executor.kube.webhook import WebhookServer, WebhookSettings
from services.executor.kube.workloads import WorkloadIntake
from services.executor.verify import SchedulerTables
from shared.config import QueuesConfig
from shared.domain import NodeSpec
from shared.events import (
    CheckpointRequested,
    JobAdmitted,
    JobCancelled,
    JobCheckpointed,
    JobFailed,
    JobIdleWarned,
    JobPending,
    JobPlaced,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobRequeued,
    JobResized,
    QueueConfigChanged,
)
from shared.service import ServiceRuntime, ServiceSpec, Tx

__all__ = ["KubeExecutor", "KubeExecutorSettings", "build_executor"]

log = logging.getLogger("gpuq.executor.kube")
MIGRATIONS = Path(__file__).resolve().parents[1] / "migrations"
BOUND_PODS_WAIT_S = 60.0  # how long the first node announcement waits for the bound pods' first list


class KubeExecutor:
    """The service: it composes its parts (one per responsibility, each in its own module) and gives the runtime
    their handlers and loops. The parts share one unit of work per decision, opened by the runtime for bus events
    and by the leadership seat (fenced) for informers and timers."""

    def __init__(self, settings: KubeExecutorSettings, api: KubeApi):
        self.scheduler_tables = SchedulerTables()  # placements are checked against the scheduler's table
        self.settings = settings
        self.cfg = settings.kube
        self.api = api
        self.notices = Notices(api)
        self.seat = Seat()
        self.config = ConfigInForce(settings.queues)
        self.dcgm = DcgmSource(settings.dcgm, self) if settings.dcgm is not None else None
        self.heartbeat = Heartbeat("executor/kube", settings.heartbeat_every_s)
        self.outcomes = Outcomes(api, self.notices, self.cfg)
        self.nodes = NodeWatch(api, self.cfg, self.seat, self.outcomes, degrades=self.dcgm is not None)
        self.pods = PodWatch(api, self.cfg, self.seat, self.notices, self.outcomes, self.nodes)
        self.runner = Runner(api, self.notices, self.outcomes, self.config, self.scheduler_tables, nodes=self.nodes)
        self.intake = WorkloadIntake(api, settings, self.seat, self.notices, self.outcomes, self.config, self.runner)
        self.plain_pods = PlainPodIntake(api, self.cfg, self.seat, self.notices, self.outcomes, self.intake)
        self.resizes = Resizes(api, self.notices, self.pods)  # elastic workloads grown and shrunk while they run
        self.stops = Stops(api, self.notices, self.outcomes, self.pods)
        self.capacity = Capacity(api, self.cfg, self.seat, self.notices, self.config, self.nodes, settings.tick_s)
        self.interruptions = Interruptions(api, self.cfg, self.seat, self.notices, self.outcomes, self.pods,
                                           settings.tick_s)
        self.nodes.on_notice = self.interruptions.on_node
        self.answers = Answers(self.notices, self.outcomes, self.capacity)
        self.timers = Timers(settings, self.seat, self.heartbeat, self.outcomes, self.pods, self.runner)

    def spec(self) -> ServiceSpec:
        background = [self.watch_cluster, self.timers.timer_loop, self.capacity.loop, self.interruptions.loop]
        background += [self.poll_gpus] if self.dcgm is not None else []
        background += [self.webhook.serve] if self.webhook is not None else []
        stops, answers = self.stops, self.answers
        return ServiceSpec(
            name="executor", schema="executor", migrations=MIGRATIONS, singleton=True,  # leader + hot standby
            handlers=fence.fenced({
                JobPlaced: self.runner.on_placed, CheckpointRequested: stops.on_checkpoint_requested,
                JobPreempted: stops.on_stopped, JobCancelled: stops.on_stopped, JobQueued: answers.on_status,
                JobPending: answers.on_status, JobAdmitted: answers.on_status, JobRejected: answers.on_status,
                JobRequeued: answers.on_status, JobCheckpointed: stops.on_checkpointed, JobFailed: stops.on_lost,
                JobIdleWarned: answers.on_idle_warned, JobResized: self.resizes.on_resized},
                lambda: self.runtime) | {QueueConfigChanged: self.config.on_config_changed},
            on_start=self.start, background=tuple(background),
        )

    @property
    def runtime(self) -> ServiceRuntime | None:
        return self.seat.runtime

    @property
    def webhook(self) -> WebhookServer | None:
        """The admission webhook, when this process serves it (set by `build_executor`)."""
        return self.config.webhook

    @webhook.setter
    def webhook(self, server: WebhookServer | None) -> None:
        self.config.webhook = server

    @property
    def queues(self) -> QueuesConfig:
        return self.config.queues

    async def start(self, runtime: ServiceRuntime) -> None:
        self.seat.runtime = runtime
        self.notices.instance = runtime.source
        await self.config.follower.start(runtime)
        self.config.configure_webhook()
        if self.dcgm is not None:  # the inventory reads the source's verdicts from its first announcement on
            async with runtime.pool.acquire() as conn:
                await ensure_health_table(conn, runtime.spec.schema)

    # ------------------------------------------------------------------ the DCGM source (ExecutorView)

    async def poll_gpus(self, runtime: ServiceRuntime) -> None:
        """The DCGM source's loop, once the informers have listed nodes and pods: before that, every series would
        name a node or pod this executor does not know yet."""
        assert self.dcgm is not None
        await self.nodes.informer.synced.wait()
        await self.pods.informer.synced.wait()
        await self.dcgm.run(runtime)

    def node_specs(self) -> Mapping[str, NodeSpec]:
        return self.nodes.node_specs()

    async def placements(self, conn: asyncpg.Connection) -> Placements:
        rows = await conn.fetch("SELECT job_id, job_label, placement, namespace FROM executor.kube_jobs "
                                "WHERE state = 'running' ORDER BY job_id")
        running = [dcgm_view.RunningJob(r["job_id"], r["job_label"], bindings_of(r), r["namespace"]) for r in rows]
        return dcgm_view.placements(running, list(self.pods.informer.cache.values()))

    async def node_announced(self, tx: Tx, node: NodeSpec) -> None:
        await self.nodes.node_announced(tx, node)

    # ------------------------------------------------------------------ informers

    async def watch_cluster(self, runtime: ServiceRuntime) -> None:
        """The pods bound to nodes (what others hold there) and the DRA devices, then nodes (the scheduler needs
        them before anything can run), then gpuq's pods and workloads."""
        tasks = [asyncio.create_task(self.nodes.bound_pod_informer.run(), name="kube-bound-pods")]
        try:
            try:  # nodes are first announced with what others hold on them, unless listing pods keeps failing
                await asyncio.wait_for(self.nodes.bound_pod_informer.synced.wait(), BOUND_PODS_WAIT_S)
            except TimeoutError:
                log.warning("the pods bound to nodes are not listed after %.0f s: the nodes are announced without "
                            "what pods gpuq does not manage hold there until they are", BOUND_PODS_WAIT_S)
            tasks += await self.nodes.watch_devices(BOUND_PODS_WAIT_S)  # DRA, where the API serves it
            tasks.append(asyncio.create_task(self.nodes.informer.run(), name="kube-nodes"))
            await self.nodes.informer.synced.wait()
            tasks += [asyncio.create_task(i.run(), name=f"kube-{i.name}")
                      for i in (self.pods.informer, *self.intake.informers, self.plain_pods.informer)]
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.api.close()  # its connections; a leader that takes the lease again watches on new ones


def build_executor(settings: KubeExecutorSettings, kubeconfig: str | Path | None) -> KubeExecutor:
    from services.executor.kube.client import load_config

    if settings.webhook is None:
        settings.webhook = WebhookSettings.from_env()
    executor = KubeExecutor(settings, KubeApi(load_config(kubeconfig), namespace=settings.kube.namespace))
    if settings.webhook is not None:  # its own client: the informers' is closed and reopened with the lease
        executor.webhook = WebhookServer(settings.webhook, settings.queues, KubeApi(load_config(kubeconfig)))
    return executor
