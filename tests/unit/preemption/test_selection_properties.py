"""Invariants of victim selection on random clusters (hypothesis)."""

from __future__ import annotations

import random
from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.preemption.core import select_victims, set_key, usage_by_queue, victim_verdict
from services.scheduler.core import Placement
from tests.unit.preemption.builders import World, queues, spec

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
