"""Scenario tests in the seed's words: gangs, racks, MIG, pools, binpack vs spread, reasons."""

from __future__ import annotations

from services.core.scheduler import ClusterState, Placement, Reason, Unplaceable, fragmentation
from shared.domain import MigLayout, NodeHealth, Taint, TaintEffect
from tests.unit.scheduler.scheduler_builders import INFERENCE_TAINT, TOLERATE_INFERENCE, job, nodes


def placed(result: Placement | Unplaceable) -> Placement:
    assert isinstance(result, Placement), result
    return result


def refused(result: Placement | Unplaceable) -> Unplaceable:
    assert isinstance(result, Unplaceable), result
    return result


def test_a_gang_of_8_is_never_half_started() -> None:
    # 2 nodes x 8 GPUs, 10 GPUs already taken: 6 free, the gang of 8 one-GPU pods cannot start.
    state = ClusterState.from_nodes(nodes(2))
    state.commit(placed(state.place(job("busy", pods=1, gpus=8))))
    state.commit(placed(state.place(job("busy2", pods=2, gpus=1))))
    before = state.fingerprint()
    why = refused(state.place(job("gang", pods=8, gpus=1)))
    assert why.reason == Reason.INSUFFICIENT_GPUS
    assert "needs 8 GPUs; 6 free of 16" in why.message
    assert state.fingerprint() == before  # nothing staged leaked into the state
    assert "gang" not in state.allocations()
    state.release("busy2")
    got = placed(state.place(job("gang", pods=8, gpus=1)))
    assert len(got.bindings) == 8 and got.gpus == 8
    assert sorted(b.pod for b in got.bindings) == [f"worker-{i}" for i in range(8)]


def test_a_16_gpu_job_is_kept_in_one_rack() -> None:
    # Racks of 2 nodes; rack0 has one node half used, so only racks 1-3 can hold 16 GPUs.
    state = ClusterState.from_nodes(nodes(8, per_rack=2))
    state.commit(placed(state.place(job("small", gpus=4))))
    got = placed(state.place(job("big", pods=2, gpus=8, required="rack")))
    assert got.racks_spanned == 1 and got.blocks_spanned == 1
    assert {state.node(b.node).rack for b in got.bindings} == {"n-rack1"}
    state.commit(got)
    state.commit(placed(state.place(job("fill", pods=1, gpus=2))))  # binpack: lands on n-0 beside "small"
    assert state.allocations()["fill"].bindings[0].node == "n-0"
    state.commit(placed(state.place(job("x", pods=1, gpus=1, models=("H100-80GB",)))))
    # A second 16-GPU job still fits in a whole rack; 20 GPUs in one rack cannot, though 25 are free.
    state.commit(placed(state.place(job("big2", pods=2, gpus=8, required="rack"))))
    why = refused(state.place(job("big3", pods=20, gpus=1, models=("H100-80GB",), required="rack")))
    assert why.reason == Reason.TOPOLOGY_UNSATISFIABLE
    assert why.message == "needs 20×H100-80GB in one rack; largest free rack has 16"
    assert state.free_gpus == 25


def test_preferred_rack_takes_best_fit_then_fewest_racks() -> None:
    state = ClusterState.from_nodes(nodes(8, per_rack=2, racks_per_block=4))
    # Make rack0 hold 8 free, rack1 16 free, rack2 8 free, rack3 16 free.
    state.commit(placed(state.place(job("r0", gpus=8))))  # n-0
    state.commit(placed(state.place(job("r2", pods=1, gpus=8, required="node"))))  # n-1 (binpack order)
    free_racks = {r: sum(state.free_on(n.name)["gpus"] for n in state.nodes() if n.rack == r)
                  for r in sorted({n.rack for n in state.nodes()})}
    assert free_racks == {"n-rack0": 0, "n-rack1": 16, "n-rack2": 16, "n-rack3": 16}
    one = placed(state.place(job("fits", pods=1, gpus=8, preferred="rack")))
    assert one.racks_spanned == 1
    # 24 GPUs fit in no rack: climb to the block and span the fewest racks (16 + 8 = 2 racks).
    wide = placed(state.place(job("wide", pods=3, gpus=8, preferred="rack")))
    assert wide.racks_spanned == 2 and wide.blocks_spanned == 1


def test_mig_slices_are_packed_and_whole_gpu_pods_avoid_partitioned_nodes() -> None:
    mig = MigLayout(profile="1g.10gb", slices_per_gpu=7)
    state = ClusterState.from_nodes(nodes(2, prefix="mig", gpus=2, mig=mig) + nodes(1, prefix="plain", gpus=8))
    a = placed(state.place(job("a", pods=3, mig="1g.10gb")))
    state.commit(a)
    # Packed: all three slices on one GPU of one node.
    assert {(b.node, b.mig_slice[0]) for b in a.bindings if b.mig_slice} == {("mig-0", 0)}
    assert sorted(b.mig_slice[1] for b in a.bindings if b.mig_slice) == [0, 1, 2]
    assert a.mig_slices == 3 and a.gpus == 0
    b = placed(state.place(job("b", pods=5, mig="1g.10gb")))
    # 4 left on mig-0 GPU 0 first, then 1 on GPU 1 of the same node (fewest free slices first).
    assert [(x.node, x.mig_slice) for x in b.bindings] == [
        ("mig-0", (0, 3)), ("mig-0", (0, 4)), ("mig-0", (0, 5)), ("mig-0", (0, 6)), ("mig-0", (1, 0))]
    whole = placed(state.place(job("whole", gpus=1)))
    assert whole.bindings[0].node == "plain-0"
    why = refused(state.place(job("other", mig="3g.40gb")))
    assert why.reason == Reason.NO_MIG_SLICES and "1g.10gb" in why.message
    why = refused(state.place(job("lots", pods=40, mig="1g.10gb")))
    assert why.reason == Reason.NO_MIG_SLICES and "25 free of 28" in why.message


def test_the_inference_pool_is_untouched_by_training() -> None:
    pool = nodes(2, prefix="inf", taints=(INFERENCE_TAINT,), labels={"pool": "inference"})
    state = ClusterState.from_nodes(nodes(1, prefix="train") + pool)
    for i in range(8):
        state.commit(placed(state.place(job(f"t{i}", gpus=1))))
    assert {p.bindings[0].node for p in state.allocations().values()} == {"train-0"}
    why = refused(state.place(job("t8", gpus=1)))
    assert why.reason == Reason.INSUFFICIENT_GPUS  # the tainted pool is not counted as capacity
    only_pool = ClusterState.from_nodes(pool)
    why = refused(only_pool.place(job("t", gpus=1)))
    assert why.reason == Reason.UNTOLERATED and "pool=inference:NoSchedule" in why.message
    serve = placed(state.place(job("serve", gpus=1, kind="inference", tolerations=(TOLERATE_INFERENCE,))))
    assert serve.bindings[0].node.startswith("inf-")


def test_prefer_no_schedule_only_lowers_the_score() -> None:
    soft = Taint(key="spot", value="yes", effect=TaintEffect.PREFER_NO_SCHEDULE)
    state = ClusterState.from_nodes(nodes(1, prefix="a", taints=(soft,)) + nodes(1, prefix="b"))
    assert placed(state.place(job("x", gpus=8))).bindings[0].node == "b-0"
    state.commit(placed(state.place(job("y", gpus=8))))
    assert placed(state.place(job("z", gpus=8))).bindings[0].node == "a-0"


def test_binpack_avoids_the_fragmentation_that_spread_causes() -> None:
    gang = job("waiting", pods=1, gpus=8)
    results = {}
    for strategy in ("binpack", "spread"):
        state = ClusterState.from_nodes(nodes(4), strategy=strategy)
        for i in range(8):
            state.commit(placed(state.place(job(f"j{i}", gpus=1))))
        results[strategy] = (fragmentation(state, [gang]), isinstance(state.place(gang), Placement))
    assert results["binpack"] == (0, True)  # one full node, three whole ones
    assert results["spread"] == (24, False)  # 2 GPUs used on every node: no whole node left


def test_datasets_break_ties_between_equally_full_nodes() -> None:
    state = ClusterState.from_nodes(nodes(3) + nodes(1, prefix="z", datasets=("imagenet",)))
    assert placed(state.place(job("d", gpus=8, datasets=("imagenet",)))).bindings[0].node == "z-0"
    state.commit(placed(state.place(job("p", gpus=2))))  # n-0 now has 6 free
    # binpack comes first: the fuller node wins over the cached dataset.
    assert placed(state.place(job("d2", gpus=1, datasets=("imagenet",)))).bindings[0].node == "n-0"


def test_unready_nodes_and_gpu_models_are_explained() -> None:
    state = ClusterState.from_nodes(nodes(2, health=NodeHealth.CORDONED) + nodes(1, prefix="a", model="A100-40GB"))
    why = refused(state.place(job("x", models=("H100-80GB",))))
    assert why.reason == Reason.NO_READY_NODES and "2 node(s)" in why.message
    why = refused(state.place(job("y", models=("B200",))))
    assert why.reason == Reason.NO_GPU_MODEL
    assert "A100-40GB (8 GPUs)" in why.message and "H100-80GB (16 GPUs)" in why.message
    # Admission's flavors restrict the any-of list.
    assert placed(state.place(job("z", models=("H100-80GB", "A100-40GB")))).bindings[0].node == "a-0"
    why = refused(state.place(job("w", models=("A100-40GB",)), allowed_models=["H100-80GB"]))
    assert why.reason == Reason.NO_GPU_MODEL and "admission allowed H100-80GB" in why.message


def test_a_degraded_node_takes_no_new_work_but_keeps_its_jobs_until_it_recovers() -> None:
    # Two nodes; a job runs on n-0; then DCGM reports an XID on n-0 and the executor marks it degraded.
    specs = nodes(2)
    state = ClusterState.from_nodes(specs)
    state.commit(placed(state.place(job("running", gpus=4))))
    assert state.allocations()["running"].bindings[0].node == "n-0"
    state.upsert_node(specs[0].model_copy(update={"health": NodeHealth.DEGRADED}))
    # Binpack would have chosen n-0 (4 free, fuller): the new job goes to the healthy node instead.
    assert {b.node for b in placed(state.place(job("new", gpus=2))).bindings} == {"n-1"}
    assert state.free_gpus() == 8 and "running" in state.allocations()  # n-0's GPUs are no capacity; job kept
    # Nothing fits on the healthy node alone: the reason names the degraded node.
    state.commit(placed(state.place(job("fill", gpus=8))))
    why = refused(state.place(job("more", gpus=1)))
    assert why.reason == Reason.INSUFFICIENT_GPUS
    state.upsert_node(specs[1].model_copy(update={"health": NodeHealth.CORDONED}))
    why = refused(state.place(job("more", gpus=1)))
    assert why.reason == Reason.NO_READY_NODES
    assert "1 cordoned, 1 degraded" in why.message and "GPU fault" in why.message
    # The fault clears: n-0 is ready again, with the running job's 4 GPUs still held.
    state.upsert_node(specs[0])
    assert {b.node for b in placed(state.place(job("after", gpus=4))).bindings} == {"n-0"}
    assert refused(state.place(job("too-big", gpus=5))).reason == Reason.INSUFFICIENT_GPUS


def test_cpu_and_memory_are_respected_per_pod() -> None:
    state = ClusterState.from_nodes(nodes(2, cpu=16_000, mem=65_536))
    why = refused(state.place(job("x", pods=4, gpus=1, cpu=10_000)))
    assert why.reason == Reason.INSUFFICIENT_CPU_MEMORY and "only 2 pod(s)" in why.message
    got = placed(state.place(job("y", pods=2, gpus=1, cpu=10_000)))
    assert len({b.node for b in got.bindings}) == 2
    state.commit(got)
    assert state.free_on("n-0")["cpu_milli"] == 6_000


def test_multi_gpu_pods_need_one_node_each() -> None:
    state = ClusterState.from_nodes(nodes(3))
    for name, gpus in (("a", 5), ("b", 5), ("d", 4)):  # leaves 3 + 3 + 4 = 10 free GPUs
        state.commit(placed(state.place(job(name, gpus=gpus))))
    why = refused(state.place(job("c", pods=2, gpus=4)))
    assert why.reason == Reason.INSUFFICIENT_GPUS
    assert why.message == ("needs 2 pod(s) × 4 GPUs, each pod on one node; free GPUs (10) allow only 1 such "
                           "pod(s), largest free on a node is 4")


def test_min_members_starts_the_gang_with_what_fits() -> None:
    state = ClusterState.from_nodes(nodes(1))
    state.commit(placed(state.place(job("a", gpus=3))))
    got = placed(state.place(job("elastic", pods=8, gpus=1, min_members=4)))
    assert len(got.bindings) == 4
    why = refused(state.place(job("rigid", pods=8, gpus=1, min_members=6)))
    assert why.reason == Reason.INSUFFICIENT_GPUS and "needs 6 GPUs" in why.message
