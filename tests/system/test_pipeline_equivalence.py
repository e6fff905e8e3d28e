"""The services and the simulator run one pipeline, and this test notices when they stop doing so, or when a
rule of the pipeline breaks in both at once.

The scenario is contended: five simultaneous arrivals of several priority classes on a full cluster, a rack gang
that needs a reservation, a job short enough to backfill in its shadow and longer ones that must wait for it
(phase A, team C); then borrowing reclaimed by its lender with a choice of victims, and a higher-priority
preemptor inside the lender's queue, each preemptor placed on the capacity held for it while another admitted
job of its priority waits (phase B, teams A and B of one cohort, and team C's c-wait).

What is compared: the sequence of decisions, each (virtual time, "admit", job, None), (virtual time, "place", job,
node+GPU bindings) or (virtual time, "preempt", victim, preemptor): a job admitted again after its preemption,
or placed again, is a decision again.

- `GOLDEN` is the simulator's sequence, checked in: a change of behaviour shows as a diff to review.
- The running services (real NATS and Postgres, the admission, scheduler and preemption services, the simulated
  executor) replay the whole scenario on a manual clock and must make exactly the same decisions, at the same
  virtual instants. The clock moves to the next instant (an arrival, a decision or a job's end) only once the
  services have committed every decision of the current one, each placed job runs on the executor from its
  placement's instant and each ended job is finished at the scheduler, or as soon as the services decide
  something the simulator did not (no sleep-and-hope: the wait is for committed state, and a divergence ends it).
  Where the two legitimately differ, the comparison says so at that spot (`run_services`).
- The mutation check: named mutants of the shared pure cores (`MUTANTS`), applied by monkeypatching the core
  functions both the services and the simulator look up at call time (`placement_key`, `priority_value`,
  `schedule_cycle`'s backfill and holds, reservations' `_earliest_slot`, victim choice through the decision loop's
  seam, `choose_victims`' `select_victims`), so one patch mutates both paths (a function renamed or no longer
  looked up there fails the check: monkeypatch refuses a missing name, and an unreached patch leaves its mutant
  alive). Under each, the simulator's decisions must leave `GOLDEN` and break at least one named key decision
  (`KEY_DECISIONS`), and so must the services' (a services run takes ~3 s here, so every mutant runs on both
  sides, ~20 s in all); the services must also make the mutated simulator's decisions, except under the one
  mutant where they legitimately differ (`DIVERGES_ON_THE_SERVICES`). A surviving mutant fails the test.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Collection, Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg
import nats
import pytest

from services.stack import Stack, StackSettings
from shared.clock import ManualClock
from shared.config import parse_cluster, parse_queues
from shared.domain import TopologyLevel
from shared.events import JobSubmitted, make_event
from shared.namespace import subject as ns_subject
from shared.service import publish_event
from sim.engine import CycleOutput, Engine
from sim.model import Trace, TraceJob
from sim.policies.gpuq import GpuqPolicy
from sim.run import make_policy

CLUSTER = parse_cluster({"node_groups": [
    {"name": "h100", "count": 4, "gpus_per_node": 8, "gpu_model": "H100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576, "nodes_per_rack": 2},
]})
QUEUES = parse_queues({
    "priority_classes": [{"name": "urgent", "value": 900, "preemptible": False},
                         {"name": "high", "value": 500, "preemptible": False},
                         {"name": "normal", "value": 100, "preemptible": True},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [
        # Phase B: the cohort's nominal quotas add up to the cluster, so team B's third job borrows team A's.
        # Team A takes its quota back from any borrower (Kueue's `Any`): team B's borrowers are of its own
        # priority, so that the job waiting in phase B (normal) asks for no preemption of its own.
        {"name": "team-a", "cohort": "research", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 16}},
         "preemption": {"reclaim_within_cohort": "Any"}},
        {"name": "team-b", "cohort": "research", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 16}}},
        # Phase A: quota never binds (admission is quota-only), GPUs do: the placement order decides.
        {"name": "team-c", "teams": ["team-c"], "quotas": {"H100-80GB": {"nominal": 96}}},
    ],
    # no checkpoint grace: a victim stops in the instant it is chosen (the simulator folds the protocol into it)
    "policy": {"protection_window_s": 60, "checkpoint_grace_s": 0},
})
PHASE_B = 10_000  # phase A has ended by then


def tj(job_id: str, team: str, submit: int, pods: int, duration: int, estimate: int | None = None,
       priority: str = "normal") -> TraceJob:
    return TraceJob(job_id=job_id, submit_time=submit, duration=duration, team=team, queue=team, pods=pods,
                    gpus_per_pod=8, gpu_models=("H100-80GB",), max_runtime_s=estimate or duration,
                    priority_class=priority, preferred_level=TopologyLevel.RACK if pods > 1 else None)


TRACE = [
    # Phase A. The cluster filled at 0 by jobs nothing may preempt (of class high: nobody waiting asks to).
    tj("c-f1", "team-c", 0, 2, 3000, priority="high"),  # rack 0 until 3000
    tj("c-f2", "team-c", 0, 1, 500, priority="high"),  # h100-2 until 500
    tj("c-f3", "team-c", 0, 1, 1000, priority="high"),  # h100-3 until 1000
    # Five arrivals at one instant, none placeable until 500. In id order c2-urgent comes third: only its
    # priority puts it first on h100-2 at 500, ahead of the gang (which then reserves rack 1 from 1300).
    tj("c-gang", "team-c", 100, 2, 1000),  # the normal-priority head: a rack gang, reserved
    tj("c1-normal", "team-c", 100, 1, 1000),  # fits h100-3 at 1000 but would delay the gang: waits
    tj("c2-urgent", "team-c", 100, 1, 800, priority="urgent"),
    tj("c3-short", "team-c", 100, 1, 250, 300),  # ends by 1300: backfills on h100-3 at 1000
    tj("c4-long", "team-c", 100, 1, 3000),
    # Phase B. Team B borrows 8 of team A's GPUs; team A reclaims them: the victim is the borrower that lost
    # least work (b-young, started last), and a-reclaim gets its GPUs.
    tj("a-1", "team-a", PHASE_B, 1, 20_000),
    tj("b-mid", "team-b", PHASE_B, 1, 20_000),
    tj("b-old", "team-b", PHASE_B, 1, 20_000),
    tj("b-young", "team-b", PHASE_B + 500, 1, 20_000),
    # Admitted before a-reclaim, of the same priority (so it asks no preemption of its own): first in the
    # placement order, it would take the GPUs each preemption frees were they not held for the preemptor.
    tj("c-wait", "team-c", PHASE_B + 600, 1, 1000),
    tj("a-reclaim", "team-a", PHASE_B + 1000, 1, 1000),
    # Team A at its quota: its urgent job preempts team A's own normal job that lost least (a-reclaim, not a-1)
    # and is placed on the GPUs held for it.
    tj("a-urgent", "team-a", PHASE_B + 1500, 1, 500, priority="urgent"),
]

# (virtual time, "admit" | "place" | "preempt", job, None | bindings | preemptor)
Decision = tuple[float, str, str, Any]
ALL_GPUS = (0, 1, 2, 3, 4, 5, 6, 7)


def _on(*nodes: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((f"h100-{n}", ALL_GPUS) for n in nodes)


GOLDEN: list[Decision] = [
    (0.0, "admit", "c-f1", None),
    (0.0, "admit", "c-f2", None),
    (0.0, "admit", "c-f3", None),
    (0.0, "place", "c-f1", _on(0, 1)),
    (0.0, "place", "c-f2", _on(2)),
    (0.0, "place", "c-f3", _on(3)),
    (100.0, "admit", "c-gang", None),
    (100.0, "admit", "c1-normal", None),
    (100.0, "admit", "c2-urgent", None),
    (100.0, "admit", "c3-short", None),
    (100.0, "admit", "c4-long", None),
    (500.0, "place", "c2-urgent", _on(2)),
    (1000.0, "place", "c3-short", _on(3)),
    (1300.0, "place", "c-gang", _on(2, 3)),
    (2300.0, "place", "c1-normal", _on(2)),
    (2300.0, "place", "c4-long", _on(3)),
    (10000.0, "admit", "a-1", None),
    (10000.0, "admit", "b-mid", None),
    (10000.0, "admit", "b-old", None),
    (10000.0, "place", "a-1", _on(0)),
    (10000.0, "place", "b-mid", _on(1)),
    (10000.0, "place", "b-old", _on(2)),
    (10500.0, "admit", "b-young", None),
    (10500.0, "place", "b-young", _on(3)),
    (10600.0, "admit", "c-wait", None),
    (11000.0, "admit", "a-reclaim", None),
    (11000.0, "preempt", "b-young", "a-reclaim"),
    (11000.0, "place", "a-reclaim", _on(3)),
    (11500.0, "admit", "a-urgent", None),
    (11500.0, "preempt", "a-reclaim", "a-urgent"),
    (11500.0, "place", "a-urgent", _on(3)),
    (12000.0, "admit", "a-reclaim", None),
    (12000.0, "place", "c-wait", _on(3)),
    (13000.0, "place", "a-reclaim", _on(3)),
    (14000.0, "admit", "b-young", None),
    (14000.0, "place", "b-young", _on(3)),
]


def simulated(trace_jobs: Sequence[TraceJob] = TRACE) -> list[Decision]:
    """The simulator's decisions with the production preemption core as its hook (`sim run gpuq`). Within an
    instant: preemptions first (they are what frees the GPUs), then placements in the order the pipeline made them."""
    trace = Trace(name="equivalence", jobs=sorted(trace_jobs, key=lambda j: (j.submit_time, j.job_id)),
                  nodes=CLUSTER.nodes(), queues=QUEUES)
    decisions: list[Decision] = []
    depth = 0

    class Recording(GpuqPolicy):
        def cycle(self, now: float) -> CycleOutput:
            nonlocal depth  # the policy cycles again, inside, after a preemption: record the outer result once
            admitted = set(self.adm.admitted) if depth == 0 else set()
            depth += 1
            try:
                out = super().cycle(now)
            finally:
                depth -= 1
            if depth == 0:
                decisions.extend((now, "admit", job_id, None) for job_id in sorted(set(self.adm.admitted) - admitted))
                decisions.extend((now, "preempt", p.job_id, p.preemptor) for p in out.preempted)
                for job_id in out.started:
                    p = self.cluster.placement_of(job_id)
                    assert p is not None
                    decisions.append((now, "place", job_id, tuple(sorted((b.node, b.gpu_indices)
                                                                         for b in p.bindings))))
            return out

    production = make_policy("gpuq")  # its hook: the production preemption core, as `gpuq-sim run gpuq` runs it
    assert isinstance(production, GpuqPolicy)
    policy = Recording(preemption=production.preemption)
    Engine(trace, policy).run()
    return decisions


def _first(decisions: Sequence[Decision], kind: str, job: str) -> Decision | None:
    return next((d for d in decisions if d[1] == kind and d[2] == job), None)


def _started_at(decisions: Sequence[Decision], job: str) -> float | None:
    d = _first(decisions, "place", job)
    return None if d is None else d[0]


# The decisions each rule is responsible for, by name: a mutant must break at least one.
KEY_DECISIONS: dict[str, Callable[[Sequence[Decision]], bool]] = {
    # priority order: the urgent job, third in id order among five simultaneous arrivals, is placed first
    "urgent job placed first, at 500": lambda d: _started_at(d, "c2-urgent") == 500.0,
    # backfill: the short job starts in the gang's shadow, before the gang
    "short job backfilled at 1000, before the gang": lambda d: (
        _started_at(d, "c3-short") == 1000.0 and (_started_at(d, "c-gang") or 0) > 1000.0),
    # reservation: the gang's slot on rack 1 is held at 1000 against the longer jobs that fit then
    "reservation held: the gang starts at 1300 on rack 1, the long jobs after it": lambda d: (
        _first(d, "place", "c-gang") == (1300.0, "place", "c-gang", _on(2, 3))
        and (_started_at(d, "c1-normal") or 0) >= 2300.0 and (_started_at(d, "c4-long") or 0) >= 2300.0),
    # victim choice: the reclaim takes the borrower that lost least (started last), nothing more
    "reclaim victim is b-young": lambda d: [x for x in d if x[0] == 11000.0 and x[1] == "preempt"]
    == [(11000.0, "preempt", "b-young", "a-reclaim")],
    # victim choice within the queue, for a higher-priority preemptor
    "urgent preemptor's victim is a-reclaim": lambda d: [x for x in d if x[0] == 11500.0 and x[1] == "preempt"]
    == [(11500.0, "preempt", "a-reclaim", "a-urgent")],
    # holds: the preemptor gets the GPUs its victim freed, in the same instant
    "preemptors placed on their victims' GPUs": lambda d: (
        _first(d, "place", "a-reclaim") == (11000.0, "place", "a-reclaim", _on(3))
        and _first(d, "place", "a-urgent") == (11500.0, "place", "a-urgent", _on(3))),
}


def broken_keys(decisions: Sequence[Decision]) -> list[str]:
    return [name for name, holds in KEY_DECISIONS.items() if not holds(decisions)]


# ---------------------------------------------------------------------------------------------- the mutants
# Each patches the shared pure core where both the services and the simulator look it up (module globals read
# at call time), so one patch mutates both paths.

def _priority_order_broken(mp: pytest.MonkeyPatch) -> None:
    """Placement order ignores priority (admission time, then id)."""
    import services.core.pipeline.book as book
    import services.core.pipeline.pipeline as pipeline

    def key(job: Any) -> tuple[int, float, str]:
        return (0, job.admitted_at, job.spec.job_id)

    mp.setattr(pipeline, "placement_key", key)
    mp.setattr(book, "placement_key", key)


def _priorities_zero(mp: pytest.MonkeyPatch) -> None:
    """Every waiting job's priority read as 0 (the scheduler service holds its own reference to the function)."""
    import services.core.pipeline.pipeline as pipeline
    import services.scheduler.app as scheduler_app

    mp.setattr(pipeline, "priority_value", lambda config, spec: 0)
    mp.setattr(scheduler_app, "priority_value", lambda config, spec: 0)


def _backfill_off(mp: pytest.MonkeyPatch) -> None:
    import services.core.pipeline.pipeline as pipeline
    from services.core.scheduler import schedule_cycle

    mp.setattr(pipeline, "schedule_cycle", lambda *a, **kw: schedule_cycle(*a, **{**kw, "backfill": False}))


def _reservations_off(mp: pytest.MonkeyPatch) -> None:
    import services.core.scheduler.cycle as cycle

    mp.setattr(cycle, "_earliest_slot", lambda *a, **kw: None)


def _victim_most_lost_work(mp: pytest.MonkeyPatch) -> None:
    """Victims ordered the wrong way round: most work lost, oldest first. Patched at the decision loop's seam:
    `choose_victims` (services/core/pipeline/preempt.py) reads `select_victims` there, and the simulator's pass,
    the ETA's replay and the preemption service all choose through it (a path that selected victims some other
    way would escape this mutant, and the services' run of it would fail)."""
    import services.core.pipeline.preempt as preempt
    import services.core.preemption.select as select

    def set_key(jobs: Sequence[Any], now: float) -> tuple[object, ...]:
        return (-round(sum(j.lost_gpu_seconds(now) for j in jobs), 6), min((j.started_at for j in jobs), default=0.0),
                len(jobs), tuple(sorted(j.job_id for j in jobs)))

    def candidate_key(job: Any, now: float) -> tuple[float, float, str]:
        return (-job.lost_gpu_seconds(now), job.started_at, job.job_id)

    real = preempt.select_victims

    def reversed_choice(*args: Any, **kwargs: Any) -> Any:
        with pytest.MonkeyPatch.context() as inner:
            inner.setattr(select, "set_key", set_key)
            inner.setattr(select, "candidate_key", candidate_key)
            return real(*args, **kwargs)

    mp.setattr(preempt, "select_victims", reversed_choice)


def _holds_off(mp: pytest.MonkeyPatch) -> None:
    """The capacity a preemption freed is not held for its preemptor."""
    import services.core.pipeline.pipeline as pipeline
    from services.core.scheduler import schedule_cycle

    mp.setattr(pipeline, "schedule_cycle", lambda *a, **kw: schedule_cycle(*a, **{**kw, "holds": ()}))


MUTANTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "priority-order-broken": _priority_order_broken,
    "priorities-zero": _priorities_zero,
    "backfill-off": _backfill_off,
    "reservations-off": _reservations_off,
    "victim-most-lost-work": _victim_most_lost_work,
    "holds-off": _holds_off,
}


def test_the_simulator_makes_the_golden_decisions() -> None:
    decisions = simulated()
    assert broken_keys(decisions) == []
    assert decisions == GOLDEN


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_mutant_of_the_pipeline_is_caught(mutant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    MUTANTS[mutant](monkeypatch)
    decisions = simulated()
    assert decisions != GOLDEN, f"mutant {mutant} survived: the decisions are unchanged"
    assert broken_keys(decisions), f"mutant {mutant} survived every key decision: {decisions}"


# ------------------------------------------------------------------------------------------------ the services
ORIGIN = 1_700_000_000.0  # virtual time 0 on the services' manual clock
SETTLE_S = 30.0  # wall seconds an instant may take to settle before the comparison shows what is missing


class Services:
    """The running services on a manual clock, with the decisions they published (job.admitted, job.placed,
    job.preempted, in the order the bus delivered them) and the committed state that says an instant has settled."""

    def __init__(self, nats_url: str, database_url: str) -> None:
        self.clock = ManualClock(ORIGIN)
        self.settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                                      services=("admission", "scheduler", "preemption", "executor"),
                                      clock=self.clock)
        self.nats_url, self.database_url = nats_url, database_url
        self.decisions: list[Decision] = []

    async def __aenter__(self) -> Services:
        self.stack = Stack(self.settings)
        await self.stack.__aenter__()
        self.nc = await nats.connect(self.nats_url)
        self.js = self.nc.jetstream()
        self.conn = await asyncpg.connect(self.database_url)

        async def placed(msg: Any) -> None:
            data = json.loads(msg.data)["data"]
            at = datetime.fromisoformat(data["placed_at"]).timestamp() - ORIGIN
            self.decisions.append((at, "place", data["job_id"], tuple(sorted(
                (b["node"], tuple(b["gpu_indices"])) for b in data["bindings"]))))

        async def admitted(msg: Any) -> None:
            data = json.loads(msg.data)["data"]
            at = datetime.fromisoformat(data["admitted_at"]).timestamp() - ORIGIN
            self.decisions.append((at, "admit", data["job_id"], None))

        async def preempted(msg: Any) -> None:
            data = json.loads(msg.data)["data"]
            at = datetime.fromisoformat(data["preempted_at"]).timestamp() - ORIGIN
            self.decisions.append((at, "preempt", data["job_id"], data["preemptor"]))

        await self.js.subscribe(ns_subject("job.admitted"), cb=admitted, ordered_consumer=True)
        await self.js.subscribe(ns_subject("job.placed"), cb=placed, ordered_consumer=True)
        await self.js.subscribe(ns_subject("job.preempted"), cb=preempted, ordered_consumer=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.conn.close()
        await self.nc.close()
        await self.stack.__aexit__(*exc)

    async def submit(self, job: TraceJob) -> None:
        # The simulator's spec; only the simulated executor reads the true duration.
        spec = job.spec().model_copy(update={"labels": {"sim.gpuq.io/duration-s": str(job.duration)}})
        at = datetime.fromtimestamp(self.clock.now(), UTC)
        await publish_event(self.js, make_event(JobSubmitted(spec=spec, submitted_at=at), source="test", time=at),
                            JobSubmitted.scoped_subject(spec.team))

    async def settle(self, now: float, simulator: Sequence[Decision], ends: dict[str, float],
                     arrived: Collection[str] | None = None) -> bool:
        """Wait until the services have committed what the simulator decided by `now` (of the decisions at
        `now`, when `arrived` names the instant's arrivals submitted so far, only theirs: their placements and the
        preemptions they made): each placement published and running on the executor from its
        placement's instant, each job due to end by `now` finished at the scheduler (a job preempted may be too,
        until it is admitted again); or until they decided something the simulator did not by `now` (a divergence
        needs no more waiting: the comparison shows it). False when it timed out or diverged."""
        allowed = {d for d in simulator if d[0] <= now}
        want = {d for d in allowed if d[0] < now or arrived is None or d[2] in arrived or d[3] in arrived}
        started: dict[str, float] = {}  # job -> its last placement by `now` (a preempted job is placed again)
        last: dict[str, str] = {}  # job -> its last decision by `now`
        for d in sorted((d for d in want if d[1] != "admit"), key=lambda d: (d[0], d[1] == "place")):
            last[d[2]] = d[1]
            if d[1] == "place":
                started[d[2]] = d[0]
        preempted = {j for j, kind in last.items() if kind == "preempt"}
        done = {j for j, end in ends.items() if end <= now}
        deadline = asyncio.get_running_loop().time() + SETTLE_S
        while asyncio.get_running_loop().time() < deadline:
            have = set(self.decisions)
            if have - allowed:
                return False
            if want <= have:
                runs = {r["job_id"]: r["started_at"] - ORIGIN for r in await self.conn.fetch(
                    "SELECT job_id, started_at FROM executor.runs")}
                finished = {r["job_id"] for r in await self.conn.fetch(
                    "SELECT job_id FROM scheduler.jobs WHERE status = 'finished'")}
                if all(runs.get(j) == t for j, t in started.items()) and done <= finished <= done | preempted:
                    return True
            await asyncio.sleep(0.05)
        return False

    async def admitted(self, job_ids: Sequence[str]) -> None:
        """Wait until the scheduler holds every one of these jobs (admitted, committed in its table)."""
        deadline = asyncio.get_running_loop().time() + SETTLE_S
        while await self.conn.fetchval("SELECT count(*) FROM scheduler.jobs WHERE job_id = ANY($1)",
                                       list(job_ids)) < len(job_ids):
            assert asyncio.get_running_loop().time() < deadline, f"not all of {job_ids} were admitted"
            await asyncio.sleep(0.05)


def _ends(decisions: Sequence[Decision]) -> dict[str, float]:
    """When each job placed in `decisions` ends (its last placement plus its true duration)."""
    duration = {j.job_id: j.duration for j in TRACE}
    return {d[2]: d[0] + duration[d[2]] for d in decisions if d[1] == "place"}


# The one instant whose arrivals are published at once: nothing fits then, so the order in which their admissions
# reach the scheduler changes nothing. Elsewhere jobs of one instant are submitted one by one, in id order, each
# once the services have settled: the services place a job as its admission arrives, the simulator all of an
# instant's arrivals in one pass in id order: the same order either way, so the same nodes.
SIMULTANEOUS = 100


async def run_services(nats_url: str, database_url: str, simulator: Sequence[Decision]) -> list[Decision]:
    """The scenario through the running services, stepped through the instants of the arrivals, of the
    simulator's decisions (`simulator`) and of the jobs' ends; returns the services' decisions, sorted.

    Within one instant the services may decide in more than one pass (a completion, or a preemption, per
    event) and publish in the order the bus delivers: the decisions of an instant are compared as a set (sorted);
    their instants, jobs, nodes, GPUs, victims and preemptors exactly.
    """
    ends = _ends(simulator)
    arrivals: dict[float, list[TraceJob]] = {}
    for job in sorted(TRACE, key=lambda j: j.job_id):
        arrivals.setdefault(float(job.submit_time), []).append(job)
    instants = sorted({*arrivals, *(d[0] for d in simulator), *ends.values()})
    async with Services(nats_url, database_url) as services:
        for now in instants:
            # Jobs ending at `now` end as the clock reaches it, while this instant's arrivals are submitted: no
            # instant of this scenario has both, whose order the bus would decide.
            services.clock.set(ORIGIN + now)
            settled = True
            if now == SIMULTANEOUS:
                await asyncio.gather(*(services.submit(j) for j in arrivals[now]))
                await services.admitted([j.job_id for j in arrivals[now]])
            else:
                submitted: set[str] = set()
                for job in arrivals.get(now, []):
                    await services.submit(job)
                    submitted.add(job.job_id)
                    settled = settled and await services.settle(now, simulator, ends, submitted)
            if not (settled and await services.settle(now, simulator, ends)):
                break  # diverged, or something is missing: later instants add nothing to the diff
        return sorted(services.decisions)


async def test_the_services_make_the_simulators_decisions_on_a_contended_workload(
        fresh: tuple[str, str]) -> None:
    assert simulated() == GOLDEN
    assert await run_services(*fresh, GOLDEN) == sorted(GOLDEN)


# Under this mutant the services legitimately differ from the simulator, and that difference is what holds are
# for: the services admit a within-queue preemptor only once its victim's JobPreempted released the quota, so
# without the hold a job already admitted takes the freed GPUs first (a-reclaim, at 11500, on a-urgent's); the
# simulator admits and places in one pass, where the preemptor's priority puts it first anyway.
DIVERGES_ON_THE_SERVICES = {"holds-off"}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
async def test_each_mutant_changes_the_services_decisions_as_the_simulators(
        mutant: str, fresh: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutants' seam reaches the services: under each mutant the services' decisions leave the golden ones,
    breaking a key decision, and (but for `DIVERGES_ON_THE_SERVICES`) are exactly the equally mutated
    simulator's."""
    MUTANTS[mutant](monkeypatch)
    mutated = simulated()
    decisions = await run_services(*fresh, mutated)
    assert decisions != sorted(GOLDEN), f"mutant {mutant} survived on the services"
    assert broken_keys(decisions), f"mutant {mutant} survived every key decision on the services: {decisions}"
    if mutant in DIVERGES_ON_THE_SERVICES:
        assert decisions != sorted(mutated)
    else:
        assert decisions == sorted(mutated)
