"""The simulator hook applies the same rules and reports less lost work with checkpointing."""

from __future__ import annotations

from dataclasses import dataclass

from services.core.pipeline import VictimChooser as SimPreemption
from shared.domain import CheckpointSpec
from tests.unit.preemption.builders import World, queues, spec

NOW = 50_000.0


@dataclass
class _Info:
    spec: object
    started_at: float
    expected_end: float


@dataclass
class _Unplaceable:
    job_id: str


class _Adm:
    def __init__(self, specs):  # type: ignore[no-untyped-def]
        self.admitted = {s.job_id: type("W", (), {"spec": s})() for s in specs}
        self.pending: dict[str, object] = {}


@dataclass
class _Ctx:
    now: float
    cluster: object
    admission: object
    unplaceable: list
    reclaims: list
    running: dict
    protection_window_s: int
    checkpoint_grace_s: int


def _ctx(world: World, specs, boss) -> _Ctx:  # type: ignore[no-untyped-def]
    running = {s.job_id: _Info(s, NOW - age, NOW - age + s.max_runtime_s) for s, age in specs}
    return _Ctx(NOW, world.cluster, _Adm([boss]), [_Unplaceable(boss.job_id)], [], running, 600, 300)


def test_hook_takes_the_unprotected_low_job_and_checkpointing_cuts_lost_work() -> None:
    lost = {}
    for checkpointing in (True, False):
        w = World(queues(), node_count=1)
        young = spec("young", gpus=4, checkpoint=CheckpointSpec(supported=True))
        old = spec("old", gpus=4, checkpoint=CheckpointSpec(supported=True))
        w.run(young, NOW - 100)
        w.run(old, NOW - 5000)
        boss = spec("boss", klass="high", gpus=4)
        hook = SimPreemption(w.config, checkpointing=checkpointing)
        out = hook(_ctx(w, [(young, 100), (old, 5000)], boss))
        assert [p.job_id for p in out] == ["old"]  # "young" is inside its protection window
        assert hook.protected_violations == 0
        lost[checkpointing] = out[0].lost_gpu_s
    assert lost[True] == 4 * 30 and lost[False] == 4 * 5000


def test_a_cooling_down_preemptor_is_decided_again_when_its_cool_down_ends() -> None:
    """"boss" was itself preempted 100 s ago: the hook takes no victim for it now (no cascades) and reports
    the end of its cool-down (the protection window, 600 s, after that preemption) as `next_wake`, when the
    simulator's policy sends the request again, as the preemption service defers it; then "old" is taken."""
    w = World(queues(), node_count=1)
    old = spec("old", gpus=8, checkpoint=CheckpointSpec(supported=True))
    w.run(old, NOW - 5000)
    boss = spec("boss", klass="high", gpus=8)
    hook = SimPreemption(w.config)
    hook.last_preempted["boss"] = NOW - 100
    assert hook(_ctx(w, [(old, 5000)], boss)) == []
    assert hook.next_wake == NOW + 500
    later = _ctx(w, [(old, 5000)], boss)
    later.now = NOW + 500
    assert [p.job_id for p in hook(later)] == ["old"] and hook.next_wake is None
