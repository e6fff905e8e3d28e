"""Admission's ETA publishing: every waiting job's expected start, refreshed off the event path by the injected ETA
function (services/eta: a forward simulation with the production cores), written to the jobs' rows and announced
as JobPending when it moved.

The cluster (nodes, and where every job holds GPUs until when) is the scheduler's fact. Admission keeps no copy of
it: each refresh reads the scheduler's read model (services/scheduler/readmodel.py) at that moment."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any, Protocol

import asyncpg

from services.admission.memory import Memory
from services.admission.publish import Published
from services.admission.sharding import Shard
from services.core.admission import AdmissionState
from services.core.scheduler import ClusterState
from services.scheduler import readmodel
from shared import forked
from shared.config import placement_strategies
from shared.domain import JobSpec
from shared.events import JobPending, utcnow_from
from shared.service import ServiceRuntime, Tx

log = logging.getLogger("gpuq.admission")

ETA_INTERVAL_S = 0.5  # wall seconds between looks at whether an ETA refresh is due (refresh_due: platform time)
ETA_DUTY_FACTOR = 5.0  # the pause after an ETA simulation is at least this many times its duration


class EtaRange(Protocol):
    """An expected start and its p10-p90 range (epoch seconds)."""

    @property
    def start(self) -> float: ...
    @property
    def low(self) -> float: ...
    @property
    def high(self) -> float: ...


class EtaFn(Protocol):
    """Expected starts {job_id: range} from (cluster, admission state, reserved ends of jobs holding GPUs, now):
    the forward simulation with the production cores and predicted durations (services/eta, PlatformEta),
    injected so the service stays thin. It learns from the starts and ends admission tells it."""

    def __call__(self, cluster: ClusterState, state: AdmissionState, reserved_ends: Mapping[str, float],
                 now: float) -> Mapping[str, EtaRange]: ...
    def job_started(self, job_id: str, started_at: float) -> None: ...
    def job_preempted(self, job_id: str, at: float) -> None: ...
    def job_finished(self, spec: JobSpec, ran_s: float | None, ended_at: float | None = None) -> None: ...
    def predicted_s(self, spec: JobSpec) -> float: ...
    def refresh_due(self, last_refresh: float | None, now: float, changed: bool) -> bool: ...
    # __call__ in steps, for a replay in a forked child (replay_forked there; learn and remember in the service's
    # process with what it returned):
    def replay_forked(self, cluster: ClusterState, state: AdmissionState, reserved_ends: Mapping[str, float],
                      now: float) -> tuple[Mapping[str, EtaRange], Any, Mapping[str, tuple[str, float]]]: ...
    def learn(self, arrivals: Any, now: float) -> None: ...  # arrivals: what replay_forked returned
    def remember(self, etas: Mapping[str, Any], queued: Mapping[str, tuple[str, float]], now: float
                 ) -> None: ...  # etas: what replay_forked returned (the implementation's own range type)


def eta_fields(memory: Memory, job_id: str) -> dict[str, datetime | None]:
    """JobPending's eta, eta_low and eta_high of a job (None when it has no ETA)."""
    eta = memory.etas.get(job_id)
    if eta is None:
        return {"eta": None, "eta_low": None, "eta_high": None}
    return {"eta": utcnow_from(eta[0]), "eta_low": utcnow_from(eta[1]), "eta_high": utcnow_from(eta[2])}


def cluster_view(rows: readmodel.ClusterRows, queue_strategies: Mapping[str, str] | None = None
                 ) -> tuple[ClusterState, dict[str, float]]:
    """The cluster for ETAs, read from its owner at refresh time (the scheduler's read model, `rows`): the nodes,
    every job holding GPUs where it holds them (every cohort's), and when the scheduler expects each to end. Pure:
    the ETA loop runs it in its worker thread. `queue_strategies`: the queues' placement strategies (queues.yaml),
    so the replay places as the scheduler does."""
    cluster = ClusterState.from_nodes((f.spec for f in readmodel.node_facts_of(rows.nodes)),
                                      queue_strategies=queue_strategies)
    expected: dict[str, float] = {}
    for p in readmodel.placements_of(rows.placements):
        try:
            cluster.commit(cluster.make_placement(p.spec, list(p.bindings)))
        except Exception as exc:  # a node removed under a placement: the scheduler reports the job's fate
            log.warning("ETA cluster view: placement of %s not restored: %s", p.job_id, exc)
            continue
        expected[p.job_id] = p.expected_end
    return cluster, expected


def _moved(eta: tuple[float, float, float] | None, old: tuple[float, float, float] | None, now: float,
           previous: float | None) -> bool:
    """Is an ETA worth publishing? When it appears, disappears or moves by more than a minute or 10% of the wait
    left, and always when the one published was ahead at the last publish and has passed since (the job still
    waits): readers are not left a time in the past (the API shows such a one as overdue until then)."""
    if eta is None and old is None:
        return False
    passed = old is not None and old[0] < now and (previous is None or old[0] > previous)
    return not (eta is not None and old is not None and not passed
                and abs(eta[0] - old[0]) <= max(60.0, 0.1 * (eta[0] - now)))


class EtaPublisher:
    """Refreshes and publishes the ETAs of this instance's waiting jobs (`memory`'s). `enter_config_epoch` moves a
    per-cohort instance to the configuration in force before it publishes for the jobs it owns; `in_fork` says
    whether a replay may run in a forked child (read at each refresh: the service's module switch)."""

    def __init__(self, memory: Memory, eta: EtaFn, interval_s: float, shard: Shard,
                 enter_config_epoch: Callable[[asyncpg.Connection], Awaitable[None]],
                 in_fork: Callable[[], bool]):
        self.memory = memory
        self.eta = eta
        self.interval_s = interval_s
        self.shard = shard
        self._enter_config_epoch = enter_config_epoch
        self._in_fork = in_fork
        self._published_at: float | None = None  # the platform time of the last publish

    async def loop(self, runtime: ServiceRuntime) -> None:
        """Refresh every waiting job's expected start by forward simulation, off the event path and off the handler
        lock: the simulation runs in a worker thread on a copy of the state (events keep being handled meanwhile),
        and only the writing of the changed ETAs takes the lock. Paced by the platform clock (runtime.clock:
        virtual time in a replay): after a change once ETA_MIN_REFRESH_S passed, otherwise every ETA_REFRESH_S
        (EtaFn.refresh_due: the simulator measures with the same pacing). Bounded: after a simulation that took
        d seconds, the next one waits at least ETA_DUTY_FACTOR x d, so ETAs use at most about 1/ETA_DUTY_FACTOR
        of the time however many jobs wait (they are refreshed less often instead)."""
        seen = -1
        last: float | None = None
        pause = self.interval_s
        memory = self.memory
        while True:
            await asyncio.sleep(pause)
            pause = self.interval_s
            if not (memory.state.pending or memory.state.admitted):
                continue
            now = runtime.clock.now()
            # an ETA that was ahead at the last refresh has passed while its job still waits: a change, refreshed as
            # soon as one may be (one given as "now", a job the replay starts at once, does not count: refreshing
            # it every 30 s would only say "now" again)
            overdue = last is not None and any(last < e[0] < now for e in memory.etas.values())
            if not self.eta.refresh_due(last, now, memory.version != seen or overdue):
                continue
            seen, last = memory.version, now
            started = time.perf_counter()
            etas = None
            if self.shard.serves_all:  # (a per-cohort instance first enters the config epoch, in the transaction)
                async with runtime.pool.acquire() as conn:
                    rows = await readmodel.cluster_rows(conn)
                etas = await self._replay_off_process(rows, now)
            async with runtime.transaction() as tx:
                await self.publish(tx, etas)
            pause = max(self.interval_s, ETA_DUTY_FACTOR * (time.perf_counter() - started))

    async def _replay_off_process(self, rows: readmodel.ClusterRows, now: float) -> Mapping[str, EtaRange]:
        """A refresh's replay off the handlers' interpreter lock: in a forked child, which reads the state as it is
        at the fork (copy-on-write: nothing copied, nothing pickled but the ETAs coming back) while the handlers go
        on changing the parent's. Where the platform cannot fork, or ETA_IN_FORK is off, in a worker thread on a
        structural copy (AdmissionState.copy, taken in one go on the event loop: no handler runs meanwhile; a deep
        copy took ~13x its CPU at 10,000 pending), which shares the GIL with the handlers (shared/forked.py)."""
        if self._in_fork() and forked.available():
            eta, state = self.eta, self.memory.state

            def replay() -> tuple[Mapping[str, EtaRange], Any, Mapping[str, tuple[str, float]]]:
                # in the child: its own copy of everything, changed or not; it finds the arrivals too (walking
                # every job held), and this process only adds the ones it found
                cluster, ends = cluster_view(rows, placement_strategies(state.config))
                return eta.replay_forked(cluster, state, ends, now)

            try:
                etas, arrivals, queued = await forked.call(replay)
            except OSError as exc:  # no fork now (out of processes or memory): this refresh in the thread instead
                log.warning("admission: ETA replay could not fork (%s); replaying in a worker thread", exc)
            else:
                eta.learn(arrivals, now)
                eta.remember(etas, queued, now)
                return etas
        # parsed in the worker thread too: a large cluster's specs take a while, and handlers go on meanwhile
        return await asyncio.to_thread(self._estimate_rows, rows, self.memory.state.copy(), now)

    def _estimate_rows(self, rows: readmodel.ClusterRows, state: AdmissionState, now: float
                       ) -> Mapping[str, EtaRange]:
        cluster, ends = cluster_view(rows, placement_strategies(state.config))
        return self._estimate(cluster, state, ends, now)

    def _estimate(self, cluster: ClusterState, state: AdmissionState, expected_end: Mapping[str, float],
                  now: float) -> Mapping[str, EtaRange]:
        """The one place the ETA function is called."""
        return self.eta(cluster, state, expected_end, now)

    async def publish(self, tx: Tx, etas: Mapping[str, EtaRange] | None = None) -> None:
        """Write and announce the ETAs that moved: `etas` as computed off the lock, or computed here (per-cohort
        instances, tests)."""
        memory = self.memory
        if etas is None:
            if not self.shard.serves_all:
                await self._enter_config_epoch(tx.conn)  # publish only for the jobs this instance owns now
            cluster, ends = cluster_view(await readmodel.cluster_rows(tx.conn),
                                         placement_strategies(memory.state.config))
            etas = self._estimate(cluster, memory.state, ends, tx.now)
        previous, self._published_at = self._published_at, tx.now
        waiting = [j for j in memory.state.pending] + [j for j in memory.state.admitted if j not in memory.expected_end]
        changed: list[tuple[str, float | None, float | None, float | None]] = []
        for job_id in sorted(waiting):
            got = etas.get(job_id)
            eta = (got.start, got.low, got.high) if got is not None else None
            if not _moved(eta, memory.etas.get(job_id), tx.now, previous):
                continue
            if eta is None:
                memory.etas.pop(job_id, None)
                changed.append((job_id, None, None, None))
            else:
                memory.etas[job_id] = eta
                changed.append((job_id, *eta))
        if changed:
            await self._write_and_announce(tx, changed)

    async def _write_and_announce(self, tx: Tx,
                                  changed: list[tuple[str, float | None, float | None, float | None]]) -> None:
        await tx.conn.execute(
            "UPDATE admission.jobs AS j SET eta = u.e, eta_low = u.l, eta_high = u.h FROM unnest($1::text[], "
            "$2::float8[], $3::float8[], $4::float8[]) AS u(id, e, l, h) WHERE j.job_id = u.id",
            *(list(c) for c in zip(*changed, strict=True)))
        rows = await tx.conn.fetch(
            "SELECT job_id, queue, status, reason, message, position_in_queue, position_in_cohort FROM admission.jobs "
            "WHERE job_id = ANY($1::text[]) ORDER BY job_id", [c[0] for c in changed])
        for r in rows:
            await tx.emit(JobPending(
                job_id=r["job_id"], queue=r["queue"], stage="admission" if r["status"] == "pending" else "placement",
                reason=r["reason"] or ("WaitingForPlacement" if r["status"] == "admitted" else "Pending"),
                message=r["message"] or "", position_in_queue=r["position_in_queue"],
                position_in_cohort=r["position_in_cohort"], **eta_fields(self.memory, r["job_id"])))
            if r["status"] == "pending" and r["reason"] and r["position_in_queue"] is not None:
                # subscribers now have this status: the cycle's next event for the job is judged against it
                self.memory.announced[r["job_id"]] = Published(r["reason"], r["message"] or "",
                                                               r["position_in_queue"], r["position_in_cohort"], tx.now)
