"""Invariants of victim selection on random clusters (hypothesis)."""

from __future__ import annotations

import random
from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.preemption import (
    PRIORITY,
    RECLAIM,
    Preemptor,
    RunningJob,
    Why,
    priority_of,
    select_victims,
    set_key,
    usage_by_queue,
    victim_verdict,
)
from services.core.preemption.model import summed_usage
from services.core.preemption.policy import victim_verdicts
from services.core.scheduler import Placement
from shared.config import QueuesConfig, parse_queues
from shared.domain import JobKind
from tests.unit.preemption.builders import MODEL, World, queues, spec

NOW = 1_000_000.0
CLASSES = ("low", "normal", "high")

job_st = st.tuples(st.sampled_from((1, 2, 4)), st.sampled_from((1, 2)), st.sampled_from(CLASSES),
                   st.integers(0, 20_000), st.one_of(st.none(), st.integers(0, 20_000)))


def build(jobs: list[tuple[int, int, str, int, int | None]]) -> World:
    w = World(queues(window=600), node_count=3, gpus=8)
    for i, (gpus, pods, klass, age, ckpt_age) in enumerate(jobs):
        s = spec(f"j{i:02d}", gpus=gpus, pods=pods, klass=klass)
        if not isinstance(w.cluster.place(s), Placement):
            continue
        w.run(s, NOW - age, None if ckpt_age is None else NOW - min(age, ckpt_age))
    return w


@settings(max_examples=150, deadline=None)
@given(st.lists(job_st, min_size=1, max_size=9), st.sampled_from((4, 8, 12)), st.sampled_from((1, 2)))
def test_chosen_set_is_sufficient_eligible_minimal_and_least_lost(jobs, gpus, pods) -> None:  # type: ignore[no-untyped-def]
    w = build(jobs)
    boss = w.preemptor(spec("boss", klass="high", gpus=gpus // pods, pods=pods))
    before = w.cluster.fingerprint()
    sel = select_victims(boss, w.running, w.cluster, w.config, NOW)
    assert w.cluster.fingerprint() == before  # what-ifs never touch the live state
    usage = usage_by_queue(w.running)
    eligible = [j for j in w.running if victim_verdict(boss, j, w.config, usage, NOW) is None]
    by_id = {j.job_id: j for j in w.running}

    def fits(ids) -> bool:  # type: ignore[no-untyped-def]
        return isinstance(w.cluster.fits_if_released(boss.spec, list(ids)), Placement)

    if not sel.victims:
        if sel.why == "FitsWithoutPreemption":
            assert fits(())
        else:
            assert not fits(j.job_id for j in eligible)  # not even all eligible jobs would do
        return
    assert fits(sel.victims)
    for v in sel.victims:
        job = by_id[v]
        assert job.priority < boss.priority and job.preemptible
        assert NOW - job.started_at >= 600 and job.expected_end - NOW >= 600
        assert not fits(x for x in sel.victims if x != v)  # every victim is needed
    # least lost work (then the other tie-breaks) among all sufficient sets of eligible jobs
    best = min((list(c) for k in range(1, len(eligible) + 1) for c in combinations(eligible, k)
                if fits(j.job_id for j in c)), key=lambda s: set_key(s, NOW))
    chosen = [by_id[v] for v in sel.victims]
    assert set_key(chosen, NOW)[0] <= set_key(best, NOW)[0] + 1e-6


@settings(max_examples=60, deadline=None)
@given(st.lists(job_st, min_size=1, max_size=9), st.randoms(use_true_random=False))
def test_same_input_same_victims_whatever_the_order(jobs, rnd: random.Random) -> None:  # type: ignore[no-untyped-def]
    w = build(jobs)
    boss = w.preemptor(spec("boss", klass="high", gpus=8))
    first = select_victims(boss, w.running, w.cluster, w.config, NOW)
    shuffled = list(w.running)
    rnd.shuffle(shuffled)
    again = select_victims(boss, shuffled, w.cluster, w.config, NOW)
    assert (first.victims, first.lost_gpu_seconds, first.why) == (again.victims, again.lost_gpu_seconds, again.why)


@settings(max_examples=100, deadline=None)
@given(st.lists(job_st, min_size=1, max_size=8), st.lists(st.integers(0, 7), max_size=5))
def test_fits_if_released_leaves_the_state_unchanged(jobs, picks) -> None:  # type: ignore[no-untyped-def]
    w = build(jobs)
    ids = [w.running[i % len(w.running)].job_id for i in picks] if w.running else []
    before = w.cluster.fingerprint()
    free_before = w.cluster.free_gpus()
    w.cluster.fits_if_released(spec("probe", gpus=8, pods=2), ids)
    assert w.cluster.fingerprint() == before
    assert w.cluster.free_gpus() == free_before
    # and the state still commits/releases as before: placing after a what-if behaves like before it
    assert set(w.cluster.allocations()) == {j.job_id for j in w.running}


_POLICIES = ("Never", "LowerPriority", "Any")


@st.composite
def _judged(draw: st.DrawFn) -> tuple[QueuesConfig, list[RunningJob], Preemptor, set[str]]:
    """A config with queues in two cohort trees (and one without a cohort), running jobs of every kind of victim
    and a preemptor asking for any reason."""
    names = ("qa", "qb", "qc", "qd", "solo")  # and "gone", a queue the config does not know
    cohorts = {"qa": "left", "qb": "left-child", "qc": "left", "qd": "right", "solo": None}
    config = parse_queues({
        "priority_classes": [{"name": "production", "value": 1000, "preemptible": False},
                             {"name": "high", "value": 500, "preemptible": False},
                             {"name": "normal", "value": 100, "preemptible": True},
                             {"name": "low", "value": 0, "preemptible": True}],
        "cohorts": [{"name": "left"}, {"name": "left-child", "parent": "left"}, {"name": "right"}],
        "queues": [{"name": q, **({"cohort": cohorts[q]} if cohorts[q] else {}),
                    "quotas": {MODEL: {"nominal": draw(st.integers(0, 6))}},
                    "preemption": {"within_queue": draw(st.sampled_from(_POLICIES)),
                                   "reclaim_within_cohort": draw(st.sampled_from(_POLICIES))}} for q in names],
        "policy": {"protection_window_s": draw(st.sampled_from((0, 600))),
                   "max_victim_loss_s": draw(st.sampled_from((None, 0, 3000)))},
    })
    running = []
    for i in range(draw(st.integers(0, 14))):
        klass = draw(st.sampled_from((*CLASSES, "production")))
        value, preemptible, production = priority_of(config, spec("x", klass=klass))
        started = NOW - draw(st.integers(0, 50_000))
        running.append(RunningJob(
            job_id=f"j{i:02d}", queue=draw(st.sampled_from((*names, "gone"))), priority_class=klass,
            priority=value, preemptible=draw(st.sampled_from((preemptible, False))) and not production,
            production=production, kind=draw(st.sampled_from(tuple(JobKind))), gpus=float(draw(st.integers(0, 4))),
            usage={MODEL: draw(st.integers(0, 4))} if draw(st.booleans()) else {}, started_at=started,
            max_runtime_s=draw(st.integers(60, 100_000)),
            last_checkpoint_at=draw(st.one_of(st.none(), st.just(started + 10.0))),
            checkpointable=draw(st.booleans()), checkpoint_cost_s=draw(st.sampled_from((None, 30.0)))))
    boss = spec(draw(st.sampled_from(("boss", "j00", "j01"))), queue=draw(st.sampled_from((*names, "gone"))),
                klass=draw(st.sampled_from(CLASSES)), kind=draw(st.sampled_from(tuple(JobKind))))
    need = {MODEL: draw(st.integers(1, 4))} if draw(st.booleans()) else {}
    preemptor = Preemptor(job_id=boss.job_id, queue=boss.queue, priority=priority_of(config, boss)[0],
                          kind=boss.kind, spec=boss, reason=draw(st.sampled_from((PRIORITY, RECLAIM))), need=need,
                          own_need=need if draw(st.booleans()) else {},
                          max_victim_priority=draw(st.sampled_from((None, 0, 100))))
    busy = draw(st.sets(st.sampled_from([j.job_id for j in running] or ["none"]), max_size=2))
    return config, running, preemptor, busy


@settings(max_examples=300, deadline=None)
@given(_judged())
def test_verdicts_judged_together_are_each_jobs_own_verdict(
        case: tuple[QueuesConfig, list[RunningJob], Preemptor, set[str]]) -> None:
    config, running, preemptor, busy = case
    usage = usage_by_queue(running)
    rejected, eligible = victim_verdicts(preemptor, running, config, usage, NOW, busy)
    one_by_one = {j.job_id: Why.BEING_PREEMPTED if j.job_id in busy
                  else victim_verdict(preemptor, j, config, usage, NOW) for j in running}
    assert list(rejected.items()) == [(j, why) for j, why in one_by_one.items() if why is not None]
    assert [j.job_id for j in eligible] == [j for j, why in one_by_one.items() if why is None]
    assert summed_usage(sorted(running, key=lambda j: j.job_id)) == usage
