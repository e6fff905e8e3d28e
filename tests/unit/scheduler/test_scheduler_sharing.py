"""GPU sharing in the placement core (issue 47): pods asking part of a GPU on time-sliced and MPS nodes, and mixed
MIG nodes exposing several profiles beside whole GPUs.

Scenarios name each rule; the properties (hypothesis) check, over random clusters and jobs, that no shared GPU is
over-committed (compute share, GPU memory, pods per GPU), that isolation classes never mix, that whole-GPU pods
and shared pods never meet on a GPU, and that gangs stay whole."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given
from hypothesis import strategies as st

from services.core.scheduler import ClusterState, Placement, PlacementConflict, Reason, Unplaceable
from shared.domain import (
    GpuBinding,
    GpuSharing,
    JobSpec,
    MigLayout,
    NodeSpec,
    PodSet,
    SharingMode,
    TopologyLevel,
    TopologyRequest,
)
from tests.unit.scheduler.scheduler_strategies import SETTINGS

TS, MPS = SharingMode.TIME_SLICING, SharingMode.MPS


def node(name: str, *, gpus: int = 4, mode: SharingMode | None = TS, replicas: int = 4, gpu_mem: int = 40_960,
         shared_gpus: int | None = None, profiles: dict[str, int] | None = None, rack: str = "r1",
         model: str = "A100-40GB", mig: MigLayout | None = None) -> NodeSpec:
    sharing = GpuSharing(mode=mode, replicas=replicas, gpu_memory_mib=gpu_mem, shared_gpus=shared_gpus) \
        if mode is not None else None
    return NodeSpec(name=name, gpus=gpus, gpu_model=model, cpu_milli=64_000, memory_mib=1 << 19, rack=rack,
                    block="b1", sharing=sharing, mig_profiles=profiles or {}, mig=mig)


def shared_job(job_id: str, *, pods: int = 1, fraction: float | None = 0.25, gmem: int | None = None,
               mode: SharingMode | None = None, min_members: int | None = None) -> JobSpec:
    ps = PodSet(name="w", count=pods, gpu_fraction=fraction, gpu_memory_mib=gmem, gpu_sharing=mode,
                cpu_milli=100, memory_mib=128)
    return JobSpec(job_id=job_id, team="t", queue="t", pod_sets=(ps,), min_members=min_members)


def whole_job(job_id: str, *, pods: int = 1, gpus: int = 1, mig: str | None = None) -> JobSpec:
    ps = PodSet(name="w", count=pods, gpus_per_pod=1 if mig else gpus, mig_profile=mig, cpu_milli=100,
                memory_mib=128)
    return JobSpec(job_id=job_id, team="t", queue="t", pod_sets=(ps,))


def placed(state: ClusterState, spec: JobSpec) -> Placement:
    p = state.place(spec)
    assert isinstance(p, Placement), p
    state.commit(p)
    return p


def test_fractions_pack_onto_a_shared_gpu_before_another_is_opened() -> None:
    state = ClusterState.from_nodes([node("a"), node("b")])
    first = placed(state, shared_job("j1", fraction=0.5))
    assert first.bindings[0].shared_gpu == 0 and first.bindings[0].share_milli == 500
    assert first.bindings[0].sharing is TS and first.gpus == 0
    # the second goes where the first is (GPU 0 of a), not onto an idle GPU
    assert placed(state, shared_job("j2", fraction=0.25)).bindings[0].shared_gpu == 0
    third = placed(state, shared_job("j3", fraction=0.5))  # 0.75 used: GPU 0 cannot hold 0.5 more
    assert (third.bindings[0].node, third.bindings[0].shared_gpu) == ("a", 1)
    # a fourth fraction fits both GPU 0 (0.25 left) and GPU 1 (0.5 left): best fit takes GPU 0
    assert placed(state, shared_job("j4", fraction=0.25)).bindings[0].shared_gpu == 0
    state.release("j1")
    state.release("j2")
    state.release("j4")
    # GPU 0 is idle again; the GPU in use (1) is packed first
    assert placed(state, shared_job("j5", fraction=0.25)).bindings[0].shared_gpu == 1


def test_a_gpu_already_shared_on_another_node_comes_before_opening_one() -> None:
    state = ClusterState.from_nodes([node("a", gpus=1), node("b", gpus=1)])
    pre = GpuBinding(pod="w-0", node="b", shared_gpu=0, share_milli=300, sharing=TS)
    state.commit(state.make_placement(shared_job("pre", fraction=0.3), [pre]))
    # b's GPU is shared already (by "pre"), a's is idle: b comes first although a ranks first
    assert placed(state, shared_job("j", fraction=0.5)).bindings[0].node == "b"
    # b has 0.2 left: the next opens a's GPU
    assert placed(state, shared_job("k", fraction=0.5)).bindings[0].node == "a"


def test_whole_gpu_pods_and_shared_pods_never_meet_on_a_gpu() -> None:
    state = ClusterState.from_nodes([node("a", gpus=4, shared_gpus=2)])
    s = placed(state, shared_job("s", pods=3, fraction=0.5))
    assert {b.shared_gpu for b in s.bindings} == {0, 1}
    w = placed(state, whole_job("w", gpus=2))
    assert w.bindings[0].gpu_indices == (2, 3)  # the node's whole GPUs, never its shared ones
    more = state.place(whole_job("w2"))
    assert isinstance(more, Unplaceable) and more.reason == Reason.INSUFFICIENT_GPUS
    state.release("s")
    # the shared GPUs are idle now, yet they stay shared: no whole-GPU pod goes there
    assert isinstance(state.place(whole_job("w3")), Unplaceable)
    # and a node sharing every GPU takes no whole-GPU pod at all
    assert isinstance(ClusterState.from_nodes([node("all")]).place(whole_job("w4")), Unplaceable)
    # a pod asking part of a GPU never lands on a node that does not share
    refused = ClusterState.from_nodes([node("plain", mode=None)]).place(shared_job("s2"))
    assert isinstance(refused, Unplaceable) and refused.reason == Reason.NO_SHARED_GPU
    assert "no node shares its GPUs" in refused.message


def test_isolation_classes_never_mix() -> None:
    state = ClusterState.from_nodes([node("ts", mode=TS), node("mps", mode=MPS, rack="r2")])
    assert placed(state, shared_job("m", mode=MPS)).bindings[0].node == "mps"
    assert placed(state, shared_job("t", mode=TS)).bindings[0].node == "ts"
    only_ts = ClusterState.from_nodes([node("ts", mode=TS)])
    refused = only_ts.place(shared_job("m2", mode=MPS))
    assert isinstance(refused, Unplaceable) and refused.reason == Reason.NO_SHARED_GPU
    assert "share GPUs by time-slicing only" in refused.message
    any_mode = placed(only_ts, shared_job("any"))  # no isolation asked: whichever the node offers
    assert any_mode.bindings[0].sharing is TS


def test_replicas_cap_the_pods_on_one_gpu_and_memory_is_never_overcommitted() -> None:
    state = ClusterState.from_nodes([node("a", gpus=1, replicas=3)])
    placed(state, shared_job("j", pods=3, fraction=0.1))
    full = state.place(shared_job("k", fraction=0.1))  # 0.3 of compute used, but 3 pods already: the cap
    assert isinstance(full, Unplaceable) and full.reason == Reason.NO_SHARED_GPU
    mem = ClusterState.from_nodes([node("m", gpus=1, gpu_mem=40_000, replicas=8)])
    p = placed(mem, shared_job("g1", fraction=None, gmem=30_000))
    assert p.bindings[0].gpu_memory_mib == 30_000 and p.bindings[0].share_milli == 750  # its memory's part
    assert isinstance(mem.place(shared_job("g2", fraction=0.1, gmem=20_000)), Unplaceable)
    assert isinstance(mem.place(shared_job("g3", fraction=None, gmem=10_000)), Placement)
    unknown = ClusterState.from_nodes([node("u", gpu_mem=0)])  # GPU memory unknown: memory cannot be checked
    assert isinstance(unknown.place(shared_job("g4", fraction=0.5, gmem=1000)), Unplaceable)


def test_gangs_of_shared_pods_are_whole_or_nothing() -> None:
    state = ClusterState.from_nodes([node("a", gpus=2, replicas=2)])
    assert isinstance(state.place(shared_job("big", pods=5, fraction=0.2)), Unplaceable)  # 4 slots only
    assert state.allocations() == {}
    some = placed(state, shared_job("some", pods=5, fraction=0.2, min_members=4))
    assert len(some.bindings) == 4


def test_a_commit_over_a_full_shared_gpu_is_a_conflict() -> None:
    state = ClusterState.from_nodes([node("a", gpus=1)])
    p = state.place(shared_job("j1", fraction=0.75))
    q = state.place(shared_job("j2", fraction=0.5))
    assert isinstance(p, Placement) and isinstance(q, Placement)
    state.commit(p)
    try:
        state.commit(q)
    except PlacementConflict as exc:
        assert "shared GPU 0 of a lacks room" in str(exc)
    else:
        raise AssertionError("a second commit over-committed the shared GPU")


def test_mixed_mig_places_slices_and_whole_gpus_on_one_node() -> None:
    state = ClusterState.from_nodes([node("m", gpus=2, mode=None, profiles={"1g.10gb": 7, "3g.40gb": 2})])
    small = placed(state, whole_job("s", pods=3, mig="1g.10gb"))
    assert [b.mig_slice for b in small.bindings] == [(0, 0), (0, 1), (0, 2)]
    big = placed(state, whole_job("b", pods=2, mig="3g.40gb"))
    assert [b.mig_slice for b in big.bindings] == [(1, 0), (1, 1)]
    whole = placed(state, whole_job("w", gpus=2))
    assert whole.bindings[0].gpu_indices == (0, 1)
    assert isinstance(state.place(whole_job("x", mig="3g.40gb")), Unplaceable)
    assert state.free_slices_by_profile() == {"A100-40GB:1g.10gb": 4, "A100-40GB:3g.40gb": 0}
    state.release("b")
    assert state.free_slices_by_profile()["A100-40GB:3g.40gb"] == 2
    # a profile the node does not expose goes elsewhere
    missing = state.place(whole_job("y", mig="2g.20gb"))
    assert isinstance(missing, Unplaceable) and missing.reason == Reason.NO_MIG_SLICES


def test_slices_go_to_partitioned_capacity_before_a_mixed_nodes_whole_gpus_are_touched() -> None:
    # a node with the profile partitioned and a node without it: the slice goes where the profile exists, and a
    # whole-GPU job still finds the mixed node's whole GPUs untouched
    state = ClusterState.from_nodes([node("mixed", gpus=1, mode=None, profiles={"1g.10gb": 7}),
                                     node("plain", gpus=1, mode=None, rack="r2")])
    assert placed(state, whole_job("s", mig="1g.10gb")).bindings[0].node == "mixed"
    assert placed(state, whole_job("w", gpus=1)).bindings[0].node in {"mixed", "plain"}
    assert placed(state, whole_job("w2", gpus=1)).bindings[0].gpu_indices == (0,)


def test_topology_and_reservations_count_shared_pods() -> None:
    state = ClusterState.from_nodes([node("a", gpus=1, rack="r1"), node("b", gpus=1, rack="r2")])
    spec = shared_job("g", pods=4, fraction=0.5).model_copy(
        update={"topology": TopologyRequest(required_level=TopologyLevel.RACK)})
    assert isinstance(state.place(spec), Unplaceable)  # 2 pods per rack at most
    ok = state.place(shared_job("g2", pods=4, fraction=0.5))
    assert isinstance(ok, Placement) and {b.node for b in ok.bindings} == {"a", "b"}


# ------------------------------------------------------------------------------------------------- properties

MODES = (TS, MPS)


@st.composite
def sharing_clusters(draw: st.DrawFn) -> list[NodeSpec]:
    out = []
    for i in range(draw(st.integers(1, 6))):
        gpus = draw(st.sampled_from((1, 2, 4)))
        kind = draw(st.sampled_from(("shared", "shared", "mixed", "plain")))
        sharing, profiles = None, {}
        if kind == "shared":
            sharing = GpuSharing(mode=draw(st.sampled_from(MODES)), replicas=draw(st.sampled_from((2, 4, 7))),
                                 gpu_memory_mib=draw(st.sampled_from((0, 16_000, 40_000))),
                                 shared_gpus=draw(st.sampled_from((None, 0, 1, gpus))))
        elif kind == "mixed":
            profiles = {"1g.10gb": draw(st.integers(0, 7)), "3g.40gb": draw(st.integers(0, 2))}
        out.append(NodeSpec(name=f"n-{i}", gpus=gpus, gpu_model="A100", cpu_milli=draw(st.sampled_from((2000, 64_000))),
                            memory_mib=1 << 18, rack=f"r{i // 2}", block="b", sharing=sharing,
                            mig_profiles=profiles))
    return out


@st.composite
def sharing_jobs(draw: st.DrawFn, job_id: str) -> JobSpec:
    sets = []
    for k in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(("shared", "shared", "whole", "mig")))
        common: dict[str, object] = {"name": f"ps{k}", "count": draw(st.integers(1, 5)),
                                     "cpu_milli": draw(st.sampled_from((0, 500))), "memory_mib": 128}
        if kind == "shared":
            frac = draw(st.sampled_from((None, 0.1, 0.25, 0.4, 0.5, 0.9)))
            gmem = draw(st.sampled_from((None, None, 4000, 12_000))) if frac is not None else 8000
            sets.append(PodSet.model_validate({**common, "gpu_fraction": frac, "gpu_memory_mib": gmem,
                                               "gpu_sharing": draw(st.sampled_from((None, TS, MPS)))}))
        elif kind == "whole":
            sets.append(PodSet.model_validate({**common, "gpus_per_pod": draw(st.integers(1, 2))}))
        else:
            sets.append(PodSet.model_validate({**common,
                                               "mig_profile": draw(st.sampled_from(("1g.10gb", "3g.40gb")))}))
    total = sum(p.count for p in sets)
    min_members = draw(st.sampled_from((None, draw(st.integers(1, total)))))
    level = draw(st.sampled_from((None, TopologyLevel.RACK)))
    return JobSpec(job_id=job_id, team="t", queue="t", pod_sets=tuple(sets), min_members=min_members,
                   topology=TopologyRequest(required_level=level))


def check_sharing_invariants(state: ClusterState, specs: dict[str, JobSpec]) -> None:
    """Recounted from the placements alone (not the index's own counters): no shared GPU over-committed, no
    isolation class mixed, whole and shared pods apart, mixed-MIG profiles within their counts, gangs whole."""
    share: dict[tuple[str, int], int] = defaultdict(int)
    gmem: dict[tuple[str, int], int] = defaultdict(int)
    pods: dict[tuple[str, int], int] = defaultdict(int)
    modes: dict[tuple[str, int], set[SharingMode]] = defaultdict(set)
    whole: set[tuple[str, int]] = set()
    slices: dict[tuple[str, int], set[int]] = defaultdict(set)
    for job_id, p in state.allocations().items():
        spec = specs[job_id]
        assert spec.gang_size <= len(p.bindings) <= spec.total_pods, "a gang started partly"
        sets = {ps.name: ps for ps in spec.pod_sets}
        for b in p.bindings:
            ps = sets[b.pod.rsplit("-", 1)[0]]
            n = state.node(b.node)
            if b.shared_gpu is not None:
                assert ps.shared and n.sharing is not None and b.shared_gpu < n.shared_gpus
                assert b.sharing is n.sharing.mode
                assert ps.gpu_sharing is None or ps.gpu_sharing is n.sharing.mode, "isolation classes mixed"
                key = (b.node, b.shared_gpu)
                share[key] += b.share_milli or 0
                gmem[key] += b.gpu_memory_mib or 0
                pods[key] += 1
                modes[key].add(b.sharing)
                if ps.gpu_fraction is not None:
                    assert b.share_milli == ps.share_milli
                assert (b.gpu_memory_mib or 0) == (ps.gpu_memory_mib or 0)
            elif b.gpu_indices:
                assert not ps.shared and not ps.mig_profile
                for g in b.gpu_indices:
                    assert n.shared_gpus <= g < n.gpus, "a whole-GPU pod on a shared GPU"
                    assert (b.node, g) not in whole
                    whole.add((b.node, g))
            elif b.mig_slice is not None:
                assert ps.mig_profile is not None
                if n.mig_profiles:
                    prof = sorted(n.mig_profiles)[b.mig_slice[0]]
                    assert prof == ps.mig_profile and b.mig_slice[1] < n.mig_profiles[prof]
                    assert b.mig_slice[1] not in slices[(b.node, b.mig_slice[0])]
                    slices[(b.node, b.mig_slice[0])].add(b.mig_slice[1])
            else:
                assert not ps.shared and not ps.gpus and not ps.mig_profile
    for key, used in share.items():
        sharing = state.node(key[0]).sharing
        assert sharing is not None
        assert used <= 1000, f"compute over-committed on {key}: {used} milli-GPUs"
        assert pods[key] <= sharing.replicas, f"{pods[key]} pods on {key}, replicas {sharing.replicas}"
        assert not gmem[key] or gmem[key] <= sharing.gpu_memory_mib, f"GPU memory over-committed on {key}"
        assert len(modes[key]) == 1
    assert not set(share) & whole


@given(data=st.data(), cluster=sharing_clusters())
@SETTINGS
def test_random_sharing_never_overcommits_never_mixes_and_keeps_gangs_whole(data: st.DataObject,
                                                                          cluster: list[NodeSpec]) -> None:
    state = ClusterState.from_nodes(cluster)
    empty = state.fingerprint()
    specs: dict[str, JobSpec] = {}
    for i in range(data.draw(st.integers(1, 12))):
        spec = data.draw(sharing_jobs(f"j{i}"))
        specs[spec.job_id] = spec
        before = state.fingerprint()
        result = state.place(spec)
        assert state.fingerprint() == before  # a pure query
        if isinstance(result, Placement):
            state.commit(result)
        else:
            assert result.reason and result.message and spec.job_id not in state.allocations()
        check_sharing_invariants(state, specs)
        if data.draw(st.booleans()) and state.allocations():
            state.release(data.draw(st.sampled_from(sorted(state.allocations()))))
        assert state.index_fingerprint() == state.rebuilt().index_fingerprint()
    # a placement restored from its bindings takes exactly what it held
    restored = ClusterState.from_nodes(cluster)
    for job_id, p in sorted(state.allocations().items()):
        restored.commit(restored.make_placement(specs[job_id], p.bindings))
    assert restored.fingerprint() == state.fingerprint()
    for job_id in sorted(state.allocations()):
        state.release(job_id)
    assert state.fingerprint() == empty


@given(data=st.data(), cluster=sharing_clusters())
@SETTINGS
def test_placements_found_on_a_what_if_copy_commit_on_the_state(data: st.DataObject, cluster: list[NodeSpec]) -> None:
    """What-ifs (release some jobs on a copy, place there) see shared and mixed-MIG capacity freed exactly."""
    state = ClusterState.from_nodes(cluster)
    specs: dict[str, JobSpec] = {}
    for i in range(6):
        spec = data.draw(sharing_jobs(f"r{i}"))
        specs[spec.job_id] = spec
        p = state.place(spec)
        if isinstance(p, Placement):
            state.commit(p)
    victims = data.draw(st.lists(st.sampled_from([*sorted(state.allocations()), "ghost"]), max_size=3))
    spec = data.draw(sharing_jobs("new"))
    answer = state.fits_if_released(spec, victims)
    manual = state.copy()
    for v in victims:
        manual.release(v)
    assert manual.place(spec) == answer
    if isinstance(answer, Placement):
        manual.commit(answer)
        specs["new"] = spec
        check_sharing_invariants(manual, specs)
