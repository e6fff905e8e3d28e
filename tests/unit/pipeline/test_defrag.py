"""Defragmentation that keeps progress (services/core/pipeline/defrag.py): a gang waiting on scattered free GPUs
gets moves of checkpointing jobs, bounded, never of a job that cannot checkpoint, never of production."""

from __future__ import annotations

from services.core.admission import AdmissionState, Workload
from services.core.pipeline import Preempted, ServiceAsks, VictimChooser, WaitingJob, decide
from services.core.pipeline.defrag import (
    DEFRAG,
    DefragmentingStage,
    Gang,
    Memory,
    Moved,
    Running,
    plan_moves,
    preemption_stage,
    why_not_movable,
)
from services.core.scheduler import ClusterState
from services.core.scheduler import RunningJob as Believed
from shared.config import Defragmentation, QueuesConfig, parse_queues
from shared.domain import CheckpointSpec, GpuBinding, JobSpec, NodeSpec, PodSet

MODEL = "H100-80GB"
ON = Defragmentation(enabled=True)


def config(window: int = 600, **defrag: object) -> QueuesConfig:
    return parse_queues({
        "priority_classes": [
            {"name": "production", "value": 1000, "preemptible": False},
            {"name": "normal", "value": 100, "preemptible": True},
            {"name": "low", "value": 0, "preemptible": True},
        ],
        "queues": [{"name": "team-a", "quotas": {MODEL: {"nominal": 64}}}],
        "policy": {"protection_window_s": window, "checkpoint_grace_s": 300,
                   "defragmentation": {"enabled": True, **defrag}},
    })


def job(job_id: str, gpus: int, pods: int = 1, klass: str = "low", checkpoint: bool = True) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", priority_class=klass,
                   pod_sets=(PodSet(count=pods, gpus_per_pod=gpus, gpu_models=(MODEL,), cpu_milli=0, memory_mib=0),),
                   max_runtime_s=36_000, checkpoint=CheckpointSpec(supported=checkpoint))


def cluster(count: int) -> ClusterState:
    return ClusterState.from_nodes([NodeSpec(name=f"n-{i}", gpus=8, gpu_model=MODEL, cpu_milli=96000,
                                             memory_mib=1 << 20, rack="r-0", block="b-0") for i in range(count)])


def put(c: ClusterState, spec: JobSpec, node: str) -> None:
    """Run `spec` (one pod) on `node`'s first GPUs (placed by hand: the test chooses the fragmentation)."""
    gpus = spec.pod_sets[0].gpus_per_pod
    c.commit(c.make_placement(spec, [GpuBinding(pod="main-0", node=node, gpu_indices=tuple(range(gpus)))]))


def scattered(a: JobSpec, b: JobSpec) -> tuple[ClusterState, dict[str, Running]]:
    """Two 8-GPU nodes, each half used (a on n-0, b on n-1): 8 GPUs free, no node with 8 free."""
    c = cluster(2)
    put(c, a, "n-0")
    put(c, b, "n-1")
    return c, {a.job_id: Running(a, 0.0), b.job_id: Running(b, 0.0)}


def gang(spec: JobSpec, priority: int = 0) -> Gang:
    return Gang(spec, (MODEL,), priority)


def test_a_scattered_cluster_yields_moves_that_let_the_gang_fit() -> None:
    c, running = scattered(job("a", 4), job("b", 4))
    big = job("big", 8)
    assert c.try_place(big) is None  # 8 free, but scattered
    [plan] = plan_moves(c, [gang(big)], running, config(), ON, Memory.empty(), 5000.0)
    [move] = plan.moves
    assert (move.job_id, move.gang) == ("a", "big")  # n-0 and n-1 miss 4 each: the first by name
    # the moved job lands on the holes (n-1's free half), the gang on what it freed (n-0)
    assert move.hint.nodes == ("n-1",) and plan.placement.nodes == ("n-0",)
    after = c.copy()
    after.release("a")
    after.commit(plan.placement)
    after.commit(move.hint)  # raises PlacementConflict if the hint overlapped the gang or b
    assert after.free_gpus() == 0


def test_a_two_pod_gang_moves_two_jobs_and_each_lands_on_a_hole() -> None:
    c = cluster(4)
    for i, name in enumerate(["a", "b", "x", "y"]):
        put(c, job(name, 4), f"n-{i}")
    [plan] = plan_moves(c, [gang(job("big", 8, pods=2))],
                        {n: Running(job(n, 4), 0.0) for n in ["a", "b", "x", "y"]}, config(), ON, Memory.empty(),
                        5000.0)
    assert sorted(m.job_id for m in plan.moves) == ["a", "b"]
    assert plan.placement.nodes == ("n-0", "n-1")
    assert sorted(n for m in plan.moves for n in m.hint.nodes) == ["n-2", "n-3"]


def test_defragmentation_never_moves_a_job_that_cannot_checkpoint() -> None:
    big = job("big", 8)
    # neither can checkpoint: no move at all
    c, running = scattered(job("a", 4, checkpoint=False), job("b", 4, checkpoint=False))
    assert plan_moves(c, [gang(big)], running, config(), ON, Memory.empty(), 5000.0) == []
    # a cannot (it would be first by node name), b can: b is the one moved
    c, running = scattered(job("a", 4, checkpoint=False), job("b", 4))
    [plan] = plan_moves(c, [gang(big)], running, config(), ON, Memory.empty(), 5000.0)
    assert [m.job_id for m in plan.moves] == ["b"]
    assert why_not_movable("a", running["a"], 0, config(), ON, Memory.empty(), 5000.0) == "cannot checkpoint"


def test_production_is_never_moved_even_for_a_production_gang() -> None:
    c, running = scattered(job("a", 4, klass="production"), job("b", 4, klass="production"))
    assert plan_moves(c, [gang(job("big", 8, klass="production"), 1000)], running, config(), ON, Memory.empty(),
                      5000.0) == []


def test_no_job_inside_its_protection_window_nor_above_the_gangs_priority_is_moved() -> None:
    c, running = scattered(job("a", 4), job("b", 4))
    assert plan_moves(c, [gang(job("big", 8))], running, config(window=6000), ON, Memory.empty(), 5000.0) == []
    c, running = scattered(job("a", 4, klass="normal"), job("b", 4, klass="normal"))
    assert plan_moves(c, [gang(job("big", 8), 0)], running, config(), ON, Memory.empty(), 5000.0) == []


def test_a_move_that_would_leave_the_moved_job_nowhere_is_not_made() -> None:
    # n-0: a (4) + 4 free; n-1, n-2: 6 used by jobs that cannot move + 2 free each. Moving a frees n-0 for the
    # gang, but a's 4 GPUs would have only 2 + 2 scattered: that is an eviction, not a move.
    c = cluster(3)
    put(c, job("a", 4), "n-0")
    put(c, job("x", 6, checkpoint=False), "n-1")
    put(c, job("y", 6, checkpoint=False), "n-2")
    running = {n: Running(job(n, g, checkpoint=n == "a"), 0.0) for n, g in [("a", 4), ("x", 6), ("y", 6)]}
    assert plan_moves(c, [gang(job("big", 8))], running, config(), ON, Memory.empty(), 5000.0) == []


def four_scattered() -> tuple[ClusterState, dict[str, Running]]:
    c = cluster(4)
    names = ["a", "b", "c", "d"]
    for i, name in enumerate(names):
        put(c, job(name, 4), f"n-{i}")
    return c, {n: Running(job(n, 4), 0.0) for n in names}


def test_the_moves_per_hour_are_bounded_cluster_wide() -> None:
    settings = Defragmentation(enabled=True, max_moves_per_hour=1)
    gangs = [gang(job("g1", 8)), gang(job("g2", 8))]
    c, running = four_scattered()
    memory = Memory.empty()
    plans = plan_moves(c, gangs, running, config(), settings, memory, 5000.0)
    assert [p.gang for p in plans] == ["g1"]  # g2 would need a second move within the hour
    memory.record(plans, 5000.0)
    # the hour is a sliding one: still none 59 minutes later, g2 gets its move after it
    assert plan_moves(c, gangs[1:], running, config(), settings, memory, 5000.0 + 3540) == []
    assert [p.gang for p in plan_moves(c, gangs[1:], running, config(), settings, memory, 5000.0 + 3601)] == ["g2"]
    # with the default bound both gangs are served in one pass (four distinct jobs, no overlap between plans)
    both = plan_moves(c, gangs, running, config(), ON, Memory.empty(), 5000.0)
    assert [p.gang for p in both] == ["g1", "g2"]
    assert len({m.job_id for p in both for m in p.moves}) == 2


def test_a_job_moved_once_is_not_moved_again_within_its_cool_down() -> None:
    c, running = scattered(job("a", 4), job("b", 4))
    memory = Memory.empty()
    memory.last_moved.update(a=4000.0, b=4000.0)
    assert plan_moves(c, [gang(job("big", 8))], running, config(), ON, memory, 5000.0) == []
    assert plan_moves(c, [gang(job("big", 8))], running, config(), ON, memory, 4000.0 + 3600)


def test_no_move_for_a_gang_planned_to_start_soon_or_that_does_not_fit_in_the_free_total() -> None:
    c, running = scattered(job("a", 4), job("b", 4))
    soon = Gang(job("big", 8), (MODEL,), 0, planned_start=5000.0 + 60)
    assert plan_moves(c, [soon], running, config(), ON, Memory.empty(), 5000.0) == []
    assert plan_moves(c, [gang(job("huge", 8, pods=2))], running, config(), ON, Memory.empty(), 5000.0) == []


class Loop:
    """The decision loop with defragmentation on, as the simulator's policy drives it."""

    def __init__(self, cfg: QueuesConfig) -> None:
        self.adm = AdmissionState(cfg)
        self.cluster = cluster(2)
        self.stage = preemption_stage(VictimChooser(cfg), ServiceAsks())
        self.waiting: dict[str, WaitingJob] = {}
        self.believed: dict[str, Believed] = {}

    def step(self, now: float, *specs: JobSpec) -> list[Preempted]:
        for s in specs:
            assert self.adm.submit(Workload(spec=s, submitted_at=now)) is None
        d = decide(self.adm, self.cluster, self.waiting, list(self.believed.values()), now, stage=self.stage)
        for w in d.admitted:
            self.waiting[w.job_id] = w
        for p in d.placement.result.placed:
            w = self.waiting.pop(p.job_id)
            self.believed[p.job_id] = Believed(job_id=p.job_id, expected_end=now + w.spec.max_runtime_s)
        return list(d.preemptions)


def test_the_decision_loop_moves_a_checkpointing_job_for_a_waiting_gang() -> None:
    loop = Loop(config())
    # a and b fill n-0 (binpack), c and d fill n-1; then b and c end: 4 + 4 free, scattered
    loop.step(0.0, job("a", 4), job("b", 4), job("c", 4), job("d", 4))
    for gone in ("b", "c"):
        loop.cluster.release(gone)
        loop.adm.finish(gone)
        loop.stage.stopped(gone)
        del loop.believed[gone]
    [move] = loop.step(5000.0, job("big", 8))
    assert (move.job_id, move.reason, move.preemptor) == ("a", DEFRAG, "big")
    assert move.checkpoint_first and move.grace_s == 300.0
    assert move.lost_gpu_s == 4 * 30.0  # the checkpoint's writing only
    assert isinstance(move, Moved) and move.hint is not None and move.hint.nodes == ("n-1",)
    assert "a" not in loop.stage.running
    # the loop's stage remembers the move (its bounds' memory)
    assert isinstance(loop.stage, DefragmentingStage) and loop.stage.defrag.moves == 1


def test_the_decision_loop_moves_nothing_when_defragmentation_is_off() -> None:
    off = config().model_copy(update={"policy": config().policy.model_copy(
        update={"defragmentation": Defragmentation()})})
    loop = Loop(off)
    assert not isinstance(loop.stage, DefragmentingStage)
    loop.step(0.0, job("a", 4), job("b", 4), job("c", 4), job("d", 4))
    for gone in ("b", "c"):
        loop.cluster.release(gone)
        loop.adm.finish(gone)
        loop.stage.stopped(gone)
        del loop.believed[gone]
    assert loop.step(5000.0, job("big", 8)) == []
