"""What pods gpuq does not manage hold on a node (`NodeSpec.held`): never free to gpuq, never placed onto; a
placement gpuq already made keeps its GPUs (the held ones move), and held units that had no room take what gpuq
frees later."""

from __future__ import annotations

from services.core.scheduler import ClusterState, Placement, Reason, Unplaceable
from shared.domain import GpuBinding, MigLayout, NodeSpec, NodeUsage
from tests.unit.scheduler.scheduler_builders import job, nodes


def placed(result: Placement | Unplaceable) -> Placement:
    assert isinstance(result, Placement), result
    return result


def refused(result: Placement | Unplaceable) -> Unplaceable:
    assert isinstance(result, Unplaceable), result
    return result


def holding(spec: NodeSpec, **held: int) -> NodeSpec:
    return spec.model_copy(update={"held": NodeUsage(**held)})


def test_held_gpus_are_not_free_and_a_gang_needing_them_waits() -> None:
    a, b = nodes(2)
    state = ClusterState.from_nodes([holding(a, gpus=8, pods=1), b])  # an inference Deployment's pod holds n-0
    assert state.free_gpus == 8 and state.total_gpus == 16 and state.free_on("n-0")["gpus"] == 0
    got = placed(state.place(job("j", pods=1, gpus=8)))
    assert [x.node for x in got.bindings] == ["n-1"]  # binpack alone would take n-0, the first by rank
    state.commit(got)
    why = refused(state.place(job("gang", pods=2, gpus=8)))  # fits only on the held GPUs
    assert why.reason == Reason.INSUFFICIENT_GPUS
    assert why.message == "needs 16 GPUs; 0 free of 16 (8 held by pods gpuq does not manage)"
    assert state.index_fingerprint() == state.rebuilt().index_fingerprint()


def test_partly_held_node_keeps_the_rest_for_gpuq_and_cpu_memory_count_too() -> None:
    (a,) = nodes(1, cpu=96_000, mem=1_048_576)
    state = ClusterState.from_nodes([holding(a, gpus=3, cpu_milli=90_000, memory_mib=0, pods=2)])
    assert state.free_on("n-0") == {"gpus": 5, "mig_slices": 0, "cpu_milli": 6000, "memory_mib": 1_048_576}
    got = placed(state.place(job("j", pods=5, gpus=1, cpu=1000)))
    assert sorted(g for x in got.bindings for g in x.gpu_indices) == [0, 1, 2, 3, 4]  # held: the highest three
    assert refused(state.place(job("k", pods=1, gpus=1, cpu=7000))).reason == Reason.INSUFFICIENT_CPU_MEMORY


def test_a_placement_made_before_the_pods_came_keeps_its_gpus_and_the_held_ones_move() -> None:
    (a,) = nodes(1)
    state = ClusterState.from_nodes([a])
    p = state.make_placement(job("j", pods=1, gpus=2), [GpuBinding(pod="worker-0", node="n-0", gpu_indices=(6, 7))])
    state.commit(p)
    state.upsert_node(holding(a, gpus=4))  # the foreign pods arrive: 4 held, on what gpuq's job leaves
    node = state.indexed_nodes["n-0"]
    assert state.free_gpus == 2 and node.held_mask == 0b0011_1100 and "j" in node.jobs
    # The same, restored after a restart: the held GPUs are announced first, the placement committed after.
    restored = ClusterState.from_nodes([holding(a, gpus=4)])
    restored.commit(restored.make_placement(job("j", pods=1, gpus=2), list(p.bindings)))
    assert restored.free_gpus == 2 and restored.indexed_nodes["n-0"].held_mask == 0b0011_1100
    assert restored.fingerprint() == state.fingerprint()


def test_held_units_without_room_take_what_gpuq_frees() -> None:
    (a,) = nodes(1)
    state = ClusterState.from_nodes([a])
    state.commit(placed(state.place(job("j", pods=1, gpus=6))))
    state.upsert_node(holding(a, gpus=4))  # 6 + 4 > 8: two held GPUs have no room (gpuq's job was there first)
    assert state.indexed_nodes["n-0"].held_units == 2 and state.free_gpus == 0
    state.release("j")
    assert state.indexed_nodes["n-0"].held_units == 4 and state.free_gpus == 4
    assert state.index_fingerprint() == state.rebuilt().index_fingerprint()


def test_held_mig_slices() -> None:
    (a,) = nodes(1, gpus=2, mig=MigLayout(profile="1g.10gb", slices_per_gpu=7))
    state = ClusterState.from_nodes([holding(a, mig_slices=9)])
    assert state.free_mig_slices == 5
    why = refused(state.place(job("j", pods=6, mig="1g.10gb")))
    assert why.reason == Reason.NO_MIG_SLICES and "(9 held by pods gpuq does not manage)" in why.message
    got = placed(state.place(job("k", pods=5, mig="1g.10gb")))
    assert {x.mig_slice[0] for x in got.bindings if x.mig_slice} == {0}  # GPU 1 is all held, and 2 of GPU 0
    state.commit(got)
    assert state.free_mig_slices == 0
