"""A node that refused a pod gpuq placed there (`NodeSpec.refused`) gets no pod of that shape or larger until the
executor announces it without the refusal (its usage changed): the next attempt goes elsewhere, or waits saying
which node refused what."""

from __future__ import annotations

from services.core.scheduler import ClusterState, PendingJob, Placement, Reason, Unplaceable, schedule_cycle
from shared.domain import NodeSpec, PlacementRefusal, PodSet, PodShape
from tests.unit.scheduler.scheduler_builders import job, nodes


def placed(result: Placement | Unplaceable) -> Placement:
    assert isinstance(result, Placement), result
    return result


def refused(result: Placement | Unplaceable) -> Unplaceable:
    assert isinstance(result, Unplaceable), result
    return result


REFUSAL = PlacementRefusal(shape=PodShape(gpus=8, cpu_milli=1000, memory_mib=4096), reason="OutOfnvidia.com/gpu",
                           message="Pod was rejected: Node didn't have enough resource: nvidia.com/gpu",
                           job_id="earlier")


def refusing(spec: NodeSpec) -> NodeSpec:
    return spec.model_copy(update={"refused": (REFUSAL,)})


def on(p: Placement) -> list[str]:
    return sorted({b.node for b in p.bindings})


def test_the_next_attempt_goes_elsewhere_and_smaller_shapes_still_go_there() -> None:
    a, b = nodes(2)
    state = ClusterState.from_nodes([refusing(a), b])
    assert on(placed(state.place(job("big", gpus=8)))) == ["n-1"]  # binpack alone would take n-0
    assert on(placed(state.place(job("more-cpu", gpus=8, cpu=2000)))) == ["n-1"]  # a larger shape: refused too
    assert on(placed(state.place(job("small", gpus=4)))) == ["n-0"]  # not covered: may fit there


def test_when_only_refusing_nodes_could_hold_it_it_waits_naming_them() -> None:
    a, b = nodes(2)
    state = ClusterState.from_nodes([refusing(a), b])
    state.commit(placed(state.place(job("busy", gpus=8))))  # n-1 full
    why = refused(state.place(job("j", gpus=8)))
    assert why.reason == Reason.PLACEMENT_REFUSED
    assert why.message == (
        "needs 8 GPUs; 0 free of 8 on the 1 ready node(s) that did not refuse it; n-0 refused a pod of 8 GPU(s), "
        "1000m CPU, 4096 MiB (OutOfnvidia.com/gpu: Pod was rejected: Node didn't have enough resource: "
        "nvidia.com/gpu): no such pod goes there until what runs there changes")
    # Not a static reason: the reservation search plans it on the node that did not refuse it.
    result = schedule_cycle(state, [PendingJob(job("j", gpus=8))], [], now=0.0, timeline=[(50.0, "busy")])
    assert result.reservations == {"j": 50.0}
    assert state.try_place_if_released(job("j", gpus=8), ["busy"]) is not None
    # The executor announces the node again without the refusal (its usage changed): it is used again.
    state.upsert_node(a)
    assert on(placed(state.place(job("j", gpus=8)))) == ["n-0"]


def test_refusals_and_selections_together() -> None:
    a, b, c = nodes(3)
    state = ClusterState.from_nodes([refusing(a.model_copy(update={"labels": {"pool": "x"}})),
                                     b.model_copy(update={"labels": {"pool": "x"}}), c])
    spec = job("j", pod_sets=(PodSet(name="w", gpus_per_pod=8, node_selector={"pool": "x"}),))
    assert on(placed(state.place(spec))) == ["n-1"]
    state.commit(placed(state.place(job("busy", gpus=8, pod_sets=spec.pod_sets))))
    why = refused(state.place(spec))
    assert why.reason == Reason.PLACEMENT_REFUSED
    assert why.message.startswith("needs 8 GPUs; 0 free of 8 on the 1 ready node(s) matching nodeSelector {pool=x} "
                                  "that did not refuse it; n-0 refused")
