"""Hierarchical cohorts (Kueue KEP-79): quota flows up a cohort tree, limits hold at every level, reclaim works
across the tree, and a flat configuration decides exactly as before."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.unit.admission.test_admission_invariants as invariants
from services.core.admission import AdmissionState, Reason, Workload, admission_cycle
from services.core.admission.cohort_tree import CohortTree
from shared.config import ConfigError, QueuesConfig, parse_queues
from tests.unit.admission.admission_core_builders import CLASSES, H100, job, queue, quota, submit, submit_many
from tests.unit.admission.test_admission_invariants import configs, op, run


def tree_config(cohorts: list[dict[str, Any]], *queues: dict[str, Any]) -> QueuesConfig:
    return parse_queues({"priority_classes": CLASSES, "cohorts": cohorts, "queues": list(queues)})


ORG = [{"name": "org"}, {"name": "vision", "parent": "org"}, {"name": "speech", "parent": "org"}]


def test_a_queue_in_a_child_cohort_borrows_idle_gpus_of_a_sibling_cohort_under_the_same_parent() -> None:
    cfg = tree_config(ORG, queue("cv", {H100: 4}, cohort="vision"), queue("asr", {H100: 4}, cohort="speech"))
    s = AdmissionState(cfg)
    submit_many(s, "cv", 8)
    d = admission_cycle(s, 1.0)
    assert len(d.admitted) == 8  # 4 of its own, 4 idle in the sibling cohort (flat cohorts: 4)
    assert s.borrowed("cv") == {H100: 4}
    assert s.available("asr", H100) == 0


def test_a_lender_in_another_child_cohort_gets_its_nominal_back_by_reclaim() -> None:
    cfg = tree_config(ORG, queue("cv", {H100: 4}, cohort="vision"), queue("asr", {H100: 4}, cohort="speech"))
    s = AdmissionState(cfg)
    borrowers = submit_many(s, "cv", 8, priority="low")
    admission_cycle(s, 1.0)
    submit(s, job("asr-big", "asr", 4), 2.0)
    d = admission_cycle(s, 3.0)
    assert d.admitted == []
    [r] = d.reclaims
    assert (r.preemptor, r.queue, r.need, r.reason) == ("asr-big", "asr", {H100: 4}, Reason.RECLAIM_QUOTA)
    assert set(r.candidates) <= set(borrowers) and len(r.candidates) == 8  # every borrower of the tree
    assert d.pending["asr-big"].reason == Reason.WAITING_FOR_RECLAIM
    for victim in r.candidates[:4]:  # the preemption service frees what is needed
        s.finish(victim)
    d = admission_cycle(s, 4.0)
    assert [a.job_id for a in d.admitted] == ["asr-big"]
    assert s.usage("asr") == {H100: 4} and s.borrowed("cv") == {}


def test_a_cohort_lending_limit_bounds_what_its_subtree_lends_to_the_parent() -> None:
    cohorts = [{"name": "org"}, {"name": "vision", "parent": "org"},
               {"name": "speech", "parent": "org", "quotas": {H100: {"lending_limit": 1}}}]
    cfg = tree_config(cohorts, queue("cv", {H100: 4}, cohort="vision"), queue("asr", {H100: 4}, cohort="speech"),
                      queue("tts", {H100: 0}, cohort="speech"))
    s = AdmissionState(cfg)
    submit_many(s, "cv", 8)
    submit_many(s, "tts", 2, t0=10.0)
    admission_cycle(s, 1.0)
    # speech keeps 3 of asr's 4 for itself: tts (same cohort) borrows first within it, cv only gets 1
    assert s.usage("cv") == {H100: 5}
    assert s.usage("tts") == {H100: 2}


def test_a_cohort_borrowing_limit_bounds_what_its_subtree_takes_from_the_parent() -> None:
    cohorts = [{"name": "org"}, {"name": "vision", "parent": "org", "quotas": {H100: {"borrowing_limit": 2}}},
               {"name": "speech", "parent": "org"}]
    cfg = tree_config(cohorts, queue("cv", {H100: 4}, cohort="vision"), queue("asr", {H100: 4}, cohort="speech"))
    s = AdmissionState(cfg)
    submit_many(s, "cv", 8)
    d = admission_cycle(s, 1.0)
    assert s.usage("cv") == {H100: 6}
    assert d.pending["cv-6"].reason == Reason.WAITING_FOR_BORROWABLE_QUOTA


def test_a_cohort_nominal_quota_is_a_shared_pool_for_its_subtree() -> None:
    cohorts = [{"name": "org", "quotas": {H100: {"nominal": 3}}}, {"name": "vision", "parent": "org"}]
    cfg = tree_config(cohorts, queue("cv", {H100: 0}, cohort="vision"))
    s = AdmissionState(cfg)
    submit_many(s, "cv", 5)
    admission_cycle(s, 1.0)
    assert s.usage("cv") == {H100: 3}


def test_the_static_tree_matches_kueues_subtree_quota() -> None:
    cohorts = [{"name": "org", "quotas": {H100: {"nominal": 2}}},
               {"name": "vision", "parent": "org", "quotas": {H100: {"lending_limit": 3, "borrowing_limit": 1}}}]
    cfg = tree_config(cohorts, queue("cv", {H100: quota(4, lending_limit=3)}, cohort="vision"),
                      queue("ocr", {H100: 2}, cohort="vision"))
    t = CohortTree(cfg)
    assert t.subtree["vision"] == {H100: 3 + 2}  # what its queues lend: (4 - 1) + 2
    assert t.local["vision"] == {H100: 2}  # 5 - lending limit 3
    assert t.subtree["org"] == {H100: 2 + 3}
    assert t.potential["vision"] == {H100: min(2 + 5, 5 + 1)}


@pytest.mark.parametrize(("cohorts", "expected"), [
    ([{"name": "a", "parent": "nowhere"}], "parent 'nowhere' is not declared"),
    ([{"name": "a", "parent": "a"}], "cannot be its own parent"),
    ([{"name": "a", "parent": "b"}, {"name": "b", "parent": "c"}, {"name": "c", "parent": "a"}],
     "cohort parents form a cycle: a -> b -> c -> a"),
    ([{"name": "a", "quotas": {H100: {"nominal": 1, "lending_limit": 0}}}], "need a parent cohort"),
])
def test_a_bad_cohort_tree_is_refused_with_what_is_wrong(cohorts: list[dict[str, Any]], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        tree_config(cohorts, queue("q", cohort="a"))
    assert expected in str(err.value)


def _with_trivial_roots(cfg: QueuesConfig, shared: bool) -> QueuesConfig:
    """The same configuration under a tree that cannot change a decision: each cohort gets a root of its own,
    or all hang under one root and lend it nothing (lending limit 0 on every model)."""
    data = cfg.model_dump(mode="json")
    models = sorted({m for q in cfg.queues for m in q.quotas})
    if shared:
        data["cohorts"] = [{"name": "all"}] + [
            {"name": c["name"], "parent": "all", "quotas": {m: {"lending_limit": 0} for m in models}}
            for c in data["cohorts"]]
    else:
        data["cohorts"] = [*data["cohorts"], *({"name": f"{c['name']}-root"} for c in data["cohorts"])]
        for c in data["cohorts"]:
            if not c["name"].endswith("-root"):
                c["parent"] = f"{c['name']}-root"
    return parse_queues(data)


def _decisions(said: list[tuple]) -> list[tuple]:
    """What was decided: rejections, admissions, per job its reason, the reclaim requests (one scope may now
    hold several cohorts, which changes the order of the list and the positions in the cohort, not a decision)."""
    out = []
    for s in said:
        if s[0] == "submit":
            out.append(s)
        else:
            _, admitted, pending, reclaims = s
            out.append((admitted, {j: (p.reason, str(p.message), p.position_in_queue) for j, p in pending.items()},
                        sorted(reclaims, key=lambda r: r.preemptor)))
    return out


@settings(max_examples=80, deadline=None)
@given(configs(), st.lists(op, min_size=5, max_size=40), st.booleans())
def test_a_flat_configuration_decides_as_the_same_under_a_trivial_root(cfg: QueuesConfig, ops: list[tuple],
                                                                       shared: bool) -> None:
    assert _decisions(run(cfg, ops)) == _decisions(run(_with_trivial_roots(cfg, shared), ops))


@st.composite
def tree_configs(draw: st.DrawFn) -> QueuesConfig:
    """A root with two child cohorts, one of them with a grandchild; random own quotas and limits per cohort;
    2-4 queues anywhere in the tree with random quotas and limits (the invariants test's); fair-sharing
    preemption on or off."""
    base = draw(configs())
    limit = st.one_of(st.none(), st.integers(0, 2))  # small limits: the ones that bind
    cohorts: list[dict[str, Any]] = [{"name": "root", "quotas": {H100: {"nominal": draw(st.integers(0, 6))}}}]
    for name, parent in (("c1", "root"), ("c2", "root"), ("c3", "c1")):
        cohorts.append({"name": name, "parent": parent, "quotas": {H100: {
            "nominal": draw(st.integers(0, 3)), "borrowing_limit": draw(limit), "lending_limit": draw(limit)}}})
    data = base.model_dump(mode="json")
    data["cohorts"] = cohorts
    for q in data["queues"]:
        q["cohort"] = draw(st.sampled_from(["root", "c1", "c2", "c3"]))
        # small H100 quotas, so that subtrees borrow from each other and the cohorts' limits bind
        nominal = draw(st.integers(0, 3))
        q["quotas"][H100] = {"nominal": nominal, "borrowing_limit": draw(st.one_of(st.none(), st.integers(0, 4))),
                             "lending_limit": draw(st.one_of(st.none(), st.integers(0, nominal)))}
    data["fair_sharing"] = {"preemption": draw(st.booleans())}
    return parse_queues(data)


def _subtree_queues(cfg: QueuesConfig, cohort: str) -> list[str]:
    roots = CohortTree(cfg).path
    return [q.name for q in cfg.queues if q.cohort is not None and cohort in roots[q.cohort]]


def _check_tree(s: AdmissionState, cfg: QueuesConfig) -> None:
    """Usage within limits at every level, from the admitted jobs alone (not from the book's aggregates)."""
    used = {q.name: s.usage(q.name).get(H100, 0) for q in cfg.queues}
    nominal = {q.name: q.quotas[H100].nominal if H100 in q.quotas else 0 for q in cfg.queues}
    own = {c.name: c.quotas[H100] for c in cfg.cohorts}
    def capacity(c: str) -> int:
        members = _subtree_queues(cfg, c)
        inner = [d.name for d in cfg.cohorts if c in CohortTree(cfg).path[d.name]]
        return sum(nominal[q] for q in members) + sum(own[d].nominal for d in inner)
    total_used, total_cap = sum(used.values()), capacity("root")
    assert total_used <= total_cap
    for c in ("c1", "c2", "c3"):
        inside = sum(used[q] for q in _subtree_queues(cfg, c))
        cap = capacity(c)
        if own[c].borrowing_limit is not None:  # what the subtree takes from outside it
            assert inside - cap <= own[c].borrowing_limit, (c, inside, cap)
        if own[c].lending_limit is not None:  # what the rest of the tree takes from the subtree's quota
            assert (total_used - inside) - (total_cap - cap) <= own[c].lending_limit, c
    for q in cfg.queues:
        fq = q.quotas.get(H100)
        if fq is None:
            continue
        if fq.borrowing_limit is not None:
            assert used[q.name] <= fq.nominal + fq.borrowing_limit
        lend = fq.lending_limit if fq.lending_limit is not None else fq.nominal
        assert (total_used - used[q.name]) - (total_cap - fq.nominal) <= lend, q.name


@settings(max_examples=250, deadline=None)
@given(tree_configs(), st.lists(op, min_size=5, max_size=40))
def test_usage_stays_within_the_limits_of_every_level_of_the_tree(cfg: QueuesConfig, ops: list[tuple]) -> None:
    s = AdmissionState(cfg)
    queues = [q.name for q in cfg.queues]
    for i, o in enumerate(ops):
        if o[0] == "submit":
            s.submit(Workload(job(f"j{i}", queues[o[1] % len(queues)], o[2], count=o[3], models=o[4],
                                  priority=o[5]), float(i)))
        elif o[0] in ("finish", "requeue") and s.admitted:
            victim = sorted(s.admitted)[o[1] % len(s.admitted)]
            if o[0] == "finish":
                s.finish(victim)
            else:
                a = s.admitted[victim]
                s.requeue(Workload(a.spec, a.submitted_at))
        elif o[0] == "cycle":
            d = admission_cycle(s, float(i), capacity=o[1], max_admissions=o[2])
            _check_tree(s, cfg)
            for r in d.reclaims:  # victims come from the same tree
                assert all(s.admitted[v].spec.queue in queues for v in r.candidates)


@settings(max_examples=80, deadline=None)
@given(tree_configs(), st.lists(op, min_size=5, max_size=40))
def test_reusing_unchanged_cohort_trees_decides_like_a_cycle_from_scratch(cfg: QueuesConfig,
                                                                          ops: list[tuple]) -> None:
    """A cycle's reuse scope is the whole tree: the invariants test's cache check, on trees."""
    invariants.test_reusing_unchanged_cohorts_decides_like_a_cycle_from_scratch.hypothesis.inner_test(cfg, ops)  # type: ignore[attr-defined]  # hypothesis' documented handle on the undecorated test
