"""The one decision loop (`services.core.pipeline.decide`): admission, placement and preemption on one snapshot.

The victims of a job found unplaceable, and of admission's reclaims, are chosen in the same pass, by the preemption
core's rules: production never, the protection window (and its retry time), the borrowers' guarantees."""

from __future__ import annotations

from services.core.admission import AdmissionState, Workload
from services.core.pipeline import (
    Choice,
    Decision,
    PreemptionStage,
    ServiceAsks,
    VictimChooser,
    WaitingJob,
    choose_victims,
    decide,
)
from services.core.preemption import PRIORITY, RECLAIM, Outcome
from services.core.scheduler import ClusterState
from services.core.scheduler import RunningJob as Believed
from shared.config import QueuesConfig
from shared.domain import CheckpointSpec, JobSpec, PodSet
from tests.unit.preemption.builders import MODEL, World, nodes, queues


def spec(job_id: str, queue: str = "team-a", gpus: int = 8, klass: str = "low", **kw: object) -> JobSpec:
    return JobSpec(job_id=job_id, team=queue, queue=queue, priority_class=klass,
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus, gpu_models=(MODEL,), cpu_milli=0, memory_mib=0),),
                   max_runtime_s=36_000, **kw)


class Loop:
    """A caller of the decision loop, keeping what the simulator's policy keeps between passes."""

    def __init__(self, config: QueuesConfig, node_count: int = 1) -> None:
        self.adm = AdmissionState(config)
        self.cluster = ClusterState.from_nodes(nodes(node_count))
        self.stage = PreemptionStage(VictimChooser(config), ServiceAsks())
        self.waiting: dict[str, WaitingJob] = {}
        self.believed: dict[str, Believed] = {}

    def submit(self, s: JobSpec, at: float) -> None:
        assert self.adm.submit(Workload(spec=s, submitted_at=at)) is None

    def decide(self, now: float) -> Decision:
        d = decide(self.adm, self.cluster, self.waiting, list(self.believed.values()), now, stage=self.stage)
        for w in d.admitted:
            self.waiting[w.job_id] = w
        for p in d.placement.result.placed:
            w = self.waiting.pop(p.job_id)
            self.believed[p.job_id] = Believed(job_id=p.job_id, expected_end=now + w.spec.max_runtime_s)
        return d


def test_the_victim_is_chosen_in_the_pass_that_found_the_preemptor_unplaceable() -> None:
    loop = Loop(queues())
    loop.submit(spec("low", gpus=8, checkpoint=CheckpointSpec(supported=True)), 0.0)
    assert [p.job_id for p in loop.decide(0.0).placement.result.placed] == ["low"]
    loop.submit(spec("boss", gpus=8, klass="normal"), 5000.0)
    d = loop.decide(5000.0)
    # one decision: boss admitted, not placed (no room), and low chosen as its victim in that same pass
    assert [w.job_id for w in d.admitted] == ["boss"]
    assert d.placement.result.placed == []
    assert "boss" in d.waiting_reasons
    [victim] = d.preemptions
    assert (victim.job_id, victim.preemptor, victim.reason) == ("low", "boss", PRIORITY)
    # the checkpoint protocol: low can checkpoint and the queues allow a grace of 300 s
    assert victim.checkpoint_first and victim.grace_s == 300.0
    assert victim.lost_gpu_s == 8 * 30.0  # only the checkpoint's writing is lost
    assert "low" not in loop.stage.running  # the stage's view: the victim no longer runs


def test_a_victim_inside_its_protection_window_is_taken_when_the_window_ends_not_before() -> None:
    loop = Loop(queues(window=600))
    loop.submit(spec("low", gpus=8), 0.0)
    loop.decide(0.0)
    loop.submit(spec("boss", gpus=8, klass="normal"), 100.0)
    d = loop.decide(100.0)
    assert d.preemptions == []
    assert d.wake_at == 600.0  # when low leaves its protection window: the request is decided again then
    assert loop.decide(300.0).preemptions == []  # asked once: nothing new to decide before the wake
    assert [p.job_id for p in loop.decide(600.0).preemptions] == ["low"]


def test_production_is_never_a_victim() -> None:
    loop = Loop(queues())
    loop.submit(spec("prod", gpus=8, klass="production"), 0.0)
    loop.decide(0.0)
    loop.submit(spec("boss", gpus=8, klass="normal", queue="team-b"), 5000.0)
    for t in (5000.0, 10_000.0, 50_000.0):
        d = loop.decide(t)
        assert d.preemptions == [] and "boss" in d.waiting_reasons


def test_a_reclaim_takes_one_borrower_back_to_its_nominal_quota_not_below() -> None:
    # team-b runs 16 GPUs on two nodes against a nominal 8 (it borrows team-a's 8); team-a asks for its 8
    loop = Loop(queues(), node_count=2)
    for i, at in enumerate((0.0, 1000.0)):
        loop.submit(spec(f"b{i}", queue="team-b", gpus=8), at)
        loop.decide(at)
    assert set(loop.believed) == {"b0", "b1"}
    loop.submit(spec("a", queue="team-a", gpus=8, klass="normal"), 5000.0)
    d = loop.decide(5000.0)
    # admission's reclaim, decided in the same pass: one borrower (the one that lost least: the newest), and
    # only one, whatever the cluster needs: team-b keeps its nominal 8
    assert [(p.job_id, p.preemptor, p.reason) for p in d.preemptions] == [("b1", "a", RECLAIM)]
    assert not d.preemptions[0].checkpoint_first  # b1 cannot checkpoint: it stops at once


def test_without_a_stage_nothing_is_preempted() -> None:
    loop = Loop(queues())
    loop.submit(spec("low", gpus=8), 0.0)
    loop.decide(0.0)
    loop.submit(spec("boss", gpus=8, klass="normal"), 5000.0)
    d = decide(loop.adm, loop.cluster, loop.waiting, list(loop.believed.values()), 5000.0,
               lowest_preemptible_running=0)
    assert d.preemptions == [] and d.wake_at is None
    assert d.placement.preemption_asks == ["boss"]  # it asks; nobody decides without a stage


# ------------------------------------------------------------------ one request's rule (`choose_victims`)
# The rule the loop's pass applies to each request and the preemption service to each PreemptionRequested.

NOW = 50_000.0


def _choose(world: World, boss: JobSpec, *, last_preempted: float | None = None,
            recent: tuple[float, ...] = ()) -> Choice:
    return choose_victims(world.preemptor(boss), world.running, world.cluster, world.config, NOW,
                          last_preempted=last_preempted, recent_victim_times=recent)


def test_one_request_takes_the_unprotected_lower_priority_job() -> None:
    w = World(queues(), node_count=1)
    w.run(spec("low", gpus=8), NOW - 5000)
    c = _choose(w, spec("boss", gpus=8, klass="normal"))
    assert (c.outcome, c.victims, c.lost_gpu_seconds) == (Outcome.STARTED, ("low",), 8 * 5000.0)


def test_one_request_is_deferred_to_the_end_of_the_protection_window_or_of_the_cool_down() -> None:
    w = World(queues(window=600), node_count=1)
    w.run(spec("young", gpus=8), NOW - 100)
    c = _choose(w, spec("boss", gpus=8, klass="normal"))
    assert (c.outcome, c.victims, c.retry_at) == (Outcome.DEFERRED, (), NOW + 500)
    old = World(queues(window=600), node_count=1)
    old.run(spec("low", gpus=8), NOW - 5000)
    # the preemptor was itself preempted 100 s ago: no cascade before its cool-down (the window) ends
    c = _choose(old, spec("boss", gpus=8, klass="normal"), last_preempted=NOW - 100)
    assert (c.outcome, c.victims, c.retry_at) == (Outcome.COOLDOWN, (), NOW + 500)


def test_one_request_respects_its_queues_hourly_limit() -> None:
    w = World(queues(max_preemptions_per_hour=1), node_count=1)
    w.run(spec("low", gpus=8), NOW - 5000)
    boss = spec("boss", gpus=8, klass="normal")
    limited = _choose(w, boss, recent=(NOW - 10,))
    assert (limited.outcome, limited.victims, limited.retry_at) == (Outcome.RATE_LIMITED, ("low",), None)
    assert _choose(w, boss, recent=(NOW - 4000,)).outcome == Outcome.STARTED  # out of the sliding hour


def test_one_request_never_takes_production_and_says_when_it_fits_without_preemption() -> None:
    w = World(queues(), node_count=2)
    w.run(spec("prod", gpus=8, klass="production"), NOW - 5000)
    assert _choose(w, spec("boss", gpus=16, klass="normal")).outcome == Outcome.NO_VICTIMS
    assert _choose(w, spec("small", gpus=8, klass="normal")).outcome == Outcome.FITS
