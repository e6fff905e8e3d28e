"""ClusterState bookkeeping: commit/release transactions, copies, what-if queries, node updates."""

from __future__ import annotations

import pytest

from services.core.scheduler import ClusterState, Placement, PlacementConflict, Reason, Unplaceable
from shared.domain import GpuBinding, MigLayout, NodeHealth
from tests.unit.scheduler.scheduler_builders import job, nodes


def placed(result: Placement | Unplaceable) -> Placement:
    assert isinstance(result, Placement), result
    return result


def test_commit_refuses_anything_taken_and_changes_nothing_then() -> None:
    state = ClusterState.from_nodes(nodes(2))
    p = placed(state.place(job("a", gpus=4)))
    q = placed(state.place(job("b", gpus=4)))  # decided on the same snapshot: same GPUs
    state.commit(p)
    before = state.fingerprint()
    with pytest.raises(PlacementConflict, match="taken"):
        state.commit(q)
    with pytest.raises(PlacementConflict, match="already placed"):
        state.commit(p)
    twice = Placement("c", (GpuBinding(pod="w-0", node="n-1", gpu_indices=(0,)),
                            GpuBinding(pod="w-1", node="n-1", gpu_indices=(0,))), 1, 1, 2, 0)
    with pytest.raises(PlacementConflict, match="bound twice"):
        state.commit(twice)
    ghost = Placement("d", (GpuBinding(pod="w-0", node="nope", gpu_indices=(0,)),), 1, 1, 1, 0)
    with pytest.raises(PlacementConflict, match="does not exist"):
        state.commit(ghost)
    assert state.fingerprint() == before


def test_release_is_idempotent_and_restores_the_state() -> None:
    state = ClusterState.from_nodes(nodes(2))
    empty = state.fingerprint()
    state.commit(placed(state.place(job("a", pods=3, gpus=4, cpu=2000))))
    assert state.free_gpus == 4 and state.used_gpus() == 12
    state.release("a")
    state.release("a")
    state.release("never-placed")
    assert state.fingerprint() == empty


def test_copy_is_independent_both_ways() -> None:
    state = ClusterState.from_nodes(nodes(4))
    state.commit(placed(state.place(job("a", gpus=8))))
    original = state.fingerprint()
    other = state.copy()
    other.commit(placed(other.place(job("b", gpus=8))))
    other.release("a")
    assert state.fingerprint() == original
    snapshot = other.fingerprint()
    state.commit(placed(state.place(job("c", gpus=2))))
    assert other.fingerprint() == snapshot
    assert "b" in other.allocations() and "b" not in state.allocations()


def test_fits_if_released_answers_without_touching_the_state() -> None:
    state = ClusterState.from_nodes(nodes(2))
    state.commit(placed(state.place(job("v1", gpus=8))))
    state.commit(placed(state.place(job("v2", gpus=8))))
    before = state.fingerprint()
    big = job("big", pods=2, gpus=8, required="rack")
    assert isinstance(state.place(big), Unplaceable)
    assert isinstance(state.fits_if_released(big, ["v1"]), Unplaceable)
    got = placed(state.fits_if_released(big, ["v1", "v2", "unknown"]))
    assert {b.node for b in got.bindings} == {"n-0", "n-1"}
    assert state.fingerprint() == before


def test_upsert_keeps_allocations_and_follows_health() -> None:
    specs = nodes(2)
    state = ClusterState.from_nodes(specs)
    state.commit(placed(state.place(job("a", gpus=6))))  # n-0
    state.upsert_node(specs[0].model_copy(update={"health": NodeHealth.CORDONED, "labels": {"x": "y"}}))
    assert state.node("n-0").labels == {"x": "y"}
    assert "a" in state.allocations()
    assert placed(state.place(job("b", gpus=1))).bindings[0].node == "n-1"  # cordoned: no new work
    assert state.total_gpus == 8
    state.upsert_node(specs[0])
    state.release("a")
    assert state.free_gpus == 16
    state.upsert_node(specs[0].model_copy(update={"name": "n-2", "rack": "n-rack0"}))
    assert state.total_gpus() == 24 and [n.name for n in state.nodes()] == ["n-0", "n-1", "n-2"]


def test_commit_on_a_cordoned_node_conflicts() -> None:
    specs = nodes(1)
    state = ClusterState.from_nodes(specs)
    p = placed(state.place(job("a", gpus=1)))
    state.upsert_node(specs[0].model_copy(update={"health": NodeHealth.FAILED}))
    with pytest.raises(PlacementConflict, match="failed"):
        state.commit(p)
    assert refused_reason(state.place(job("b", gpus=1))) == Reason.NO_READY_NODES


def refused_reason(result: Placement | Unplaceable) -> str:
    assert isinstance(result, Unplaceable)
    return result.reason


def test_make_placement_rebuilds_cpu_accounting_from_the_spec() -> None:
    state = ClusterState.from_nodes(nodes(1, cpu=8000))
    spec = job("a", pods=2, gpus=1, cpu=3000)
    p = placed(state.place(spec))
    rebuilt = state.make_placement(spec, p.bindings)
    assert rebuilt == p
    state.commit(rebuilt)
    assert state.free_on("n-0")["cpu_milli"] == 2000


def test_mig_helpers_count_slices_and_whole_gpus() -> None:
    state = ClusterState.from_nodes(nodes(1, gpus=2, mig=MigLayout(profile="1g.10gb", slices_per_gpu=7)))
    assert state.free_gpus == 2 and state.free_mig_slices == 14
    state.commit(placed(state.place(job("a", mig="1g.10gb"))))
    assert state.free_gpus == 1 and state.free_mig_slices == 13
    assert state.free_gpus_by_model() == {"H100-80GB": 1}


def test_strategy_is_validated() -> None:
    with pytest.raises(ValueError, match="strategy"):
        ClusterState.from_nodes(nodes(1), strategy="random")
