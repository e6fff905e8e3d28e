"""Invariants over random clusters and jobs (hypothesis): no partial starts, nothing given twice, every
constraint respected, queries pure, backfill never delays the reservation."""

from __future__ import annotations

import dataclasses
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from services.core.scheduler import (
    ClusterState,
    PendingJob,
    Placement,
    RunningJob,
    Unplaceable,
    may_fit_if_released,
    schedule_cycle,
)
from services.core.scheduler.staging import placement_shape, resolve, trim
from shared.domain import JobSpec, NodeHealth, NodeSpec, TaintEffect
from tests.unit.scheduler.scheduler_strategies import MODELS, SETTINGS, clusters, jobs


def check_placement(state: ClusterState, spec: JobSpec, p: Placement, allowed: tuple[str, ...] = ()) -> None:
    """Every constraint of the spec holds and every resource bound is free in `state`."""
    assert p.job_id == spec.job_id
    assert spec.gang_size <= len(p.bindings) <= spec.total_pods  # the gang, never less
    assert len({b.pod for b in p.bindings}) == len(p.bindings)
    sets = {ps.name: ps for ps in spec.pod_sets}
    used: Counter[tuple[str, object]] = Counter()
    cpu: Counter[str] = Counter()
    mem: Counter[str] = Counter()
    for b in p.bindings:
        name, index = b.pod.rsplit("-", 1)
        ps = sets[name]
        assert 0 <= int(index) < ps.count
        node = state.node(b.node)
        assert node.health is NodeHealth.READY
        models = tuple(m for m in allowed if not ps.gpu_models or m in ps.gpu_models) if allowed else ps.gpu_models
        if ps.gpus_per_pod or ps.mig_profile:
            assert not models or node.gpu_model in models
        for t in node.taints:
            if t.effect is not TaintEffect.PREFER_NO_SCHEDULE:
                assert any(tol.tolerates(t) for tol in spec.tolerations)
        assert all(node.labels.get(k) == v for k, v in ps.selector.items())
        assert ps.affinity is None or ps.affinity.required_matches(node.labels, node.name)
        shape = (0 if ps.mig_profile else ps.gpus_per_pod, ps.mig_profile, ps.cpu_milli, ps.memory_mib)
        assert node.refuses(*shape) is None, "a pod of a shape the node refused"
        held = state.indexed_nodes[b.node]
        assert not any(held.held_mask >> g & 1 for g in b.gpu_indices), "a GPU held outside gpuq"
        if b.mig_slice is not None and held.held_slices is not None:
            assert not held.held_slices[b.mig_slice[0]] >> b.mig_slice[1] & 1, "a slice held outside gpuq"
        if ps.mig_profile:
            assert node.mig is not None and node.mig.profile == ps.mig_profile
            assert b.mig_slice is not None and not b.gpu_indices
            used[(b.node, ("slice", *b.mig_slice))] += 1
        else:
            assert b.mig_slice is None and len(b.gpu_indices) == ps.gpus_per_pod
            if ps.gpus_per_pod:
                assert node.mig is None  # whole-GPU pods never on a partitioned node
            for g in b.gpu_indices:
                assert 0 <= g < node.gpus
                used[(b.node, g)] += 1
        cpu[b.node] += ps.cpu_milli
        mem[b.node] += ps.memory_mib
    assert all(v == 1 for v in used.values()), "a GPU or slice bound twice in one placement"
    for name in cpu:
        free = state.free_on(name)
        assert cpu[name] <= free["cpu_milli"] and mem[name] <= free["memory_mib"]
    level = spec.topology.required_level
    if level is not None:
        assert len({state.node(b.node).domain(level) for b in p.bindings}) == 1
    assert p.racks_spanned == len({state.node(b.node).rack for b in p.bindings})
    assert p.blocks_spanned == len({state.node(b.node).block for b in p.bindings})


def check_index_matches_a_rebuild(state: ClusterState) -> None:
    """The incrementally kept buckets equal the ones a full rebuild computes from the nodes."""
    assert state.index_fingerprint() == state.rebuilt().index_fingerprint()


def check_no_double_allocation(state: ClusterState) -> None:
    seen: set[tuple[str, object]] = set()
    for p in state.allocations().values():
        for b in p.bindings:
            keys = [(b.node, g) for g in b.gpu_indices] + ([(b.node, b.mig_slice)] if b.mig_slice else [])
            for k in keys:
                assert k not in seen, f"{k} given twice"
                seen.add(k)
    for n in state.nodes():
        free = state.free_on(n.name)
        assert free["cpu_milli"] >= 0 and free["memory_mib"] >= 0
        # what pods outside gpuq hold stays theirs: never free, never given (the placer never takes it)
        node = state.indexed_nodes[n.name]
        assert not node.held_mask & node.free_mask
        assert node.held_units == (n.held.mig_slices if n.mig else n.held.gpus)


@given(data=st.data(), cluster=clusters(), strategy=st.sampled_from(("binpack", "spread")))
@SETTINGS
def test_random_place_commit_release_keeps_every_invariant(data: st.DataObject, cluster: list[NodeSpec],
                                                           strategy: str) -> None:
    state = ClusterState.from_nodes(cluster, strategy=strategy)
    empty = state.fingerprint()
    for i in range(data.draw(st.integers(1, 10))):
        spec = data.draw(jobs(f"j{i}"))
        allowed = data.draw(st.sampled_from(((), ("H100-80GB",), MODELS)))
        before = state.fingerprint()
        result = state.place(spec, allowed)
        assert state.fingerprint() == before  # place is a pure query
        if isinstance(result, Placement):
            check_placement(state, spec, result, allowed)
            state.commit(result)
        else:
            assert isinstance(result, Unplaceable) and result.reason and result.message
            assert spec.job_id not in state.allocations()  # no partial start
        check_no_double_allocation(state)
        if data.draw(st.booleans()) and state.allocations():
            victim = data.draw(st.sampled_from(sorted(state.allocations())))
            state.release(victim)
        check_index_matches_a_rebuild(state)
    for job_id in sorted(state.allocations()):
        state.release(job_id)
    assert state.fingerprint() == empty


@given(data=st.data(), cluster=clusters())
@SETTINGS
def test_what_if_queries_leave_the_state_unchanged(data: st.DataObject, cluster: list[NodeSpec]) -> None:
    state = ClusterState.from_nodes(cluster)
    for i in range(6):
        p = state.place(data.draw(jobs(f"r{i}")))
        if isinstance(p, Placement):
            state.commit(p)
    before = state.fingerprint()
    spec = data.draw(jobs("new"))
    victims = data.draw(st.lists(st.sampled_from([*sorted(state.allocations()), "ghost"]), max_size=3))
    answer = state.fits_if_released(spec, victims)
    assert state.fingerprint() == before
    manual = state.copy()
    for v in victims:
        manual.release(v)
    assert manual.place(spec) == answer
    if isinstance(answer, Placement):
        check_placement(manual, spec, answer)
        manual.commit(answer)
    assert state.fingerprint() == before


@given(data=st.data(), cluster=clusters(), backfill=st.booleans())
@SETTINGS
def test_backfill_never_delays_the_reservation(data: st.DataObject, cluster: list[NodeSpec], backfill: bool) -> None:
    state = ClusterState.from_nodes(cluster)
    running = []
    for i in range(data.draw(st.integers(0, 12))):  # a busy cluster, so heads block and reservations exist
        p = state.place(data.draw(jobs(f"r{i}")))
        if isinstance(p, Placement):
            state.commit(p)
            running.append(RunningJob(p.job_id, float(data.draw(st.integers(1, 5000)))))
    pending = [PendingJob(data.draw(jobs(f"p{i}"))) for i in range(data.draw(st.integers(1, 8)))]
    result = schedule_cycle(state, pending, running, 0.0, backfill=backfill)
    placed = {p.job_id for p in result.placed}
    refused = [u.job_id for u in result.unplaceable]
    assert sorted([*placed, *refused]) == sorted(pj.spec.job_id for pj in pending)  # every job answered once
    assert set(result.reservations) <= set(refused)
    check_no_double_allocation(state)
    specs = {pj.spec.job_id: pj.spec for pj in pending}
    for p in result.placed:
        assert state.allocations()[p.job_id] == p
    for job_id, start in result.reservations.items():
        # Replay: at the planned start, every job expected to have ended is gone; the head must fit.
        future = state.copy()
        ends = [(r.expected_end, r.job_id) for r in running]
        ends += [(specs[j].max_runtime_s, j) for j in placed]
        for end, jid in sorted(ends):
            if end <= start:
                future.release(jid)
        assert isinstance(future.place(specs[job_id]), Placement), (job_id, start)


@given(data=st.data(), cluster=clusters())
@SETTINGS
def test_batched_releases_and_cheap_what_ifs_answer_what_one_by_one_releases_answer(data: st.DataObject,
                                                                                   cluster: list[NodeSpec]) -> None:
    """`release_many` leaves the state (and its buckets) that releasing the jobs one by one leaves;
    `try_place_if_released` gives `fits_if_released`'s placement (None where it would explain a refusal); and
    `may_fit_if_released` never contradicts it, and answers whenever the pods that must start form one pod set."""
    state = ClusterState.from_nodes(cluster)
    for i in range(data.draw(st.integers(0, 10))):
        p = state.place(data.draw(jobs(f"r{i}")))
        if isinstance(p, Placement):
            state.commit(p)
    if data.draw(st.booleans()) and cluster:  # a node that changed under its jobs (cordoned, or fewer GPUs)
        node = data.draw(st.sampled_from(cluster))
        state.upsert_node(node.model_copy(update={"health": NodeHealth.CORDONED, "gpus": node.gpus // 2}))
    before = state.fingerprint()
    victims = data.draw(st.lists(st.sampled_from([*sorted(state.allocations()), "ghost"]), max_size=6))
    one_by_one, batched = state.copy(), state.copy()
    for v in victims:
        one_by_one.release(v)
    batched.release_many(victims)
    assert batched.fingerprint() == one_by_one.fingerprint()
    assert batched.index_fingerprint() == one_by_one.index_fingerprint()
    check_index_matches_a_rebuild(batched)
    spec = data.draw(jobs("new"))
    allowed = data.draw(st.sampled_from(((), ("H100-80GB",), MODELS)))
    answer = state.fits_if_released(spec, victims, allowed)
    assert state.try_place_if_released(spec, victims, allowed) == (answer if isinstance(answer, Placement) else None)
    assert state.try_place(spec, allowed) == (lambda p: p if isinstance(p, Placement) else None)(state.place(spec,
                                                                                                             allowed))
    may = may_fit_if_released(state, spec, allowed, victims)
    assert may is not False if isinstance(answer, Placement) else may is not True
    resolved = resolve(spec, allowed)
    if not isinstance(resolved, Unplaceable) and len(trim(resolved, spec.gang_size)) == 1:
        assert may is not None  # one pod set must start: the count is exact
    assert state.fingerprint() == before


@given(data=st.data(), cluster=clusters())
@SETTINGS
def test_jobs_of_one_placement_shape_get_one_answer(data: st.DataObject, cluster: list[NodeSpec]) -> None:
    """What the scheduler's refusal memo and the fragmentation count rely on: a spec's placement (or refusal,
    reason and message) depends on its `placement_shape` only, the job id aside."""
    state = ClusterState.from_nodes(cluster)
    for i in range(data.draw(st.integers(0, 8))):
        p = state.place(data.draw(jobs(f"r{i}")))
        if isinstance(p, Placement):
            state.commit(p)
    spec = data.draw(jobs("one"))
    twin = spec.model_copy(update={"job_id": "two", "team": "other", "queue": "other", "max_runtime_s": 7,
                                   "priority_class": "high"})
    assert placement_shape(twin) == placement_shape(spec)
    allowed = data.draw(st.sampled_from(((), ("H100-80GB",), MODELS)))
    first, second = state.place(spec, allowed), state.place(twin, allowed)
    if isinstance(first, Placement):
        assert isinstance(second, Placement) and second == dataclasses.replace(first, job_id="two")
    else:
        assert second == Unplaceable("two", first.reason, first.message)
