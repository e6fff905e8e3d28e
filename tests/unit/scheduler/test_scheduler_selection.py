"""What a workload asks of node labels and taints, honoured by the placement core: nodeSelector, required node
affinity (In, NotIn, Exists, DoesNotExist, Gt, Lt, ORed terms, matchFields on the node name), per-pod-set
tolerations, preferred node affinity as a score, and a refusal naming the selector when no node can ever match."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.core.scheduler import ClusterState, Placement, Reason, Unplaceable, schedule_cycle
from services.core.scheduler.types import PendingJob
from shared.domain import (
    NodeAffinity,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    NodeSpec,
    PodSet,
    PodTemplate,
    PreferredSchedulingTerm,
    Taint,
    TaintEffect,
    Toleration,
)
from tests.unit.scheduler.scheduler_builders import job, nodes


def placed(result: Placement | Unplaceable) -> Placement:
    assert isinstance(result, Placement), result
    return result


def refused(result: Placement | Unplaceable) -> Unplaceable:
    assert isinstance(result, Unplaceable), result
    return result


def labelled(**pools: str) -> list[NodeSpec]:
    """One 8-GPU node per entry, named after the key, with `pool=<value>` (and a `gen` label on two)."""
    out = []
    for i, (name, pool) in enumerate(pools.items()):
        (spec,) = nodes(1, prefix=name)
        labels = {"pool": pool, "kubernetes.io/hostname": name} | ({"gen": str(3 + i)} if i < 2 else {})
        out.append(spec.model_copy(update={"name": name, "labels": labels}))
    return out


def term(*exprs: tuple[str, str, tuple[str, ...]]) -> NodeSelectorTerm:
    return NodeSelectorTerm(match_expressions=tuple(NodeSelectorRequirement(key=k, operator=op, values=v)
                                                    for k, op, v in exprs))


def one_set(*, pods: int = 1, gpus: int = 8, selector: dict[str, str] | None = None,
            affinity: NodeAffinity | None = None, tolerations: tuple[Toleration, ...] = ()) -> tuple[PodSet, ...]:
    return (PodSet(name="worker", count=pods, gpus_per_pod=gpus, node_selector=selector or {}, affinity=affinity,
                   tolerations=tolerations),)


def nodes_of(p: Placement) -> list[str]:
    return sorted({b.node for b in p.bindings})


def test_node_selector_keeps_pods_on_matching_nodes_only() -> None:
    # Binpack would put the job on `a` (first by rank); its nodeSelector sends it to `c`.
    state = ClusterState.from_nodes(labelled(a="spot", b="spot", c="reserved"))
    got = placed(state.place(job("j", pod_sets=one_set(selector={"pool": "reserved"}))))
    assert nodes_of(got) == ["c"]
    state.commit(got)
    # The matching node is full: the job waits (never goes to the free spot nodes), saying where it looked.
    why = refused(state.place(job("k", pod_sets=one_set(selector={"pool": "reserved"}))))
    assert why.reason == Reason.INSUFFICIENT_GPUS
    assert why.message == ("needs 8 GPUs; 0 free of 8 on the 1 ready node(s) matching nodeSelector "
                           "{pool=reserved}")


@pytest.mark.parametrize(("exprs", "expected"), [
    ((("pool", "In", ("reserved", "other")),), ["c"]),
    ((("pool", "NotIn", ("spot",)),), ["c", "d"]),  # d has no pool label: NotIn matches it
    ((("gen", "Exists", ()),), ["a", "b"]),
    ((("gen", "DoesNotExist", ()),), ["c", "d"]),
    ((("gen", "Gt", ("3",)),), ["b"]),
    ((("gen", "Lt", ("4",)),), ["a"]),
    ((("gen", "Exists", ()), ("pool", "In", ("spot",))), ["a", "b"]),  # ANDed within a term
])
def test_required_affinity_operators(exprs: tuple[tuple[str, str, tuple[str, ...]], ...],
                                     expected: list[str]) -> None:
    specs = labelled(a="spot", b="spot", c="reserved")
    (d,) = nodes(1, prefix="d")
    specs.append(d.model_copy(update={"name": "d", "labels": {}}))
    state = ClusterState.from_nodes(specs)
    affinity = NodeAffinity(required=(term(*exprs),))
    got = placed(state.place(job("j", pod_sets=one_set(pods=len(expected), affinity=affinity))))
    assert nodes_of(got) == expected  # one 8-GPU pod per matching node: exactly the matching ones


def test_required_terms_are_ored_and_match_fields_name_the_node() -> None:
    state = ClusterState.from_nodes(labelled(a="spot", b="spot", c="reserved"))
    by_name = NodeSelectorTerm(match_fields=(NodeSelectorRequirement(key="metadata.name", operator="In",
                                                                     values=("b",)),))
    affinity = NodeAffinity(required=(term(("pool", "In", ("reserved",))), by_name))
    got = placed(state.place(job("j", pod_sets=one_set(pods=2, affinity=affinity))))
    assert nodes_of(got) == ["b", "c"]
    # An empty term matches no node, as in Kubernetes.
    why = refused(state.place(job("k", pod_sets=one_set(affinity=NodeAffinity(required=(NodeSelectorTerm(),))))))
    assert why.reason == Reason.NO_MATCHING_NODE


def test_a_job_no_node_can_ever_match_is_refused_naming_the_selector() -> None:
    state = ClusterState.from_nodes(labelled(a="spot", b="reserved"))
    affinity = NodeAffinity(required=(term(("zone", "In", ("eu-1",))),))
    spec = job("j", pod_sets=one_set(selector={"pool": "a100"}, affinity=affinity))
    why = refused(state.place(spec))
    assert why.reason == Reason.NO_MATCHING_NODE
    assert why.message == ("pod set worker asks nodeSelector {pool=a100} and node affinity zone In [eu-1]: none of "
                           "the 2 node(s) with any model it may use matches; their labels: pool=reserved, pool=spot, "
                           "zone absent")
    # Static: releasing running jobs cannot cure it, so no reservation is searched or held for it.
    result = schedule_cycle(state, [PendingJob(spec)], [], now=0.0)
    assert [u.reason for u in result.unplaceable] == [Reason.NO_MATCHING_NODE] and not result.reservations


def test_each_pod_set_is_judged_on_its_own_selector_and_tolerations() -> None:
    taint = Taint(key="dedicated", value="eval", effect=TaintEffect.NO_SCHEDULE)
    specs = labelled(a="train", b="train", c="eval")
    specs[2] = specs[2].model_copy(update={"taints": (taint,)})
    state = ClusterState.from_nodes(specs)
    tolerate = Toleration(key="dedicated", value="eval", effect=TaintEffect.NO_SCHEDULE)
    sets = (PodSet(name="trainer", count=2, gpus_per_pod=8, node_selector={"pool": "train"}),
            PodSet(name="evaluator", count=1, gpus_per_pod=4, node_selector={"pool": "eval"}, tolerations=(tolerate,)))
    got = placed(state.place(job("j", pod_sets=sets)))
    by_set = {b.pod.rsplit("-", 1)[0]: set() for b in got.bindings}
    for b in got.bindings:
        by_set[b.pod.rsplit("-", 1)[0]].add(b.node)
    assert by_set == {"trainer": {"a", "b"}, "evaluator": {"c"}}
    # Without its toleration the evaluator cannot use the tainted node its selector names.
    untolerated = (sets[0], sets[1].model_copy(update={"tolerations": ()}))
    why = refused(state.place(job("k", pod_sets=untolerated)))
    assert why.reason == Reason.UNTOLERATED and "dedicated=eval:NoSchedule" in why.message


def test_template_selector_and_tolerations_count_too() -> None:
    taint = Taint(key="dedicated", value="eval", effect=TaintEffect.NO_SCHEDULE)
    specs = labelled(a="train", b="eval")
    specs[1] = specs[1].model_copy(update={"taints": (taint,)})
    state = ClusterState.from_nodes(specs)
    tmpl = PodTemplate(image="img", node_selector={"pool": "eval"},
                       tolerations=(Toleration(key="dedicated", operator="Exists"),))
    got = placed(state.place(job("j", pod_sets=(PodSet(name="w", gpus_per_pod=8, template=tmpl),))))
    assert nodes_of(got) == ["b"]
    with pytest.raises(ValidationError, match="disagree on pool"):
        PodSet(name="w", node_selector={"pool": "train"}, template=tmpl)


def test_preferred_affinity_orders_nodes_by_weight_and_never_forces() -> None:
    state = ClusterState.from_nodes(labelled(a="spot", b="spot", c="reserved"))
    prefer = NodeAffinity(preferred=(
        PreferredSchedulingTerm(weight=10, preference=term(("pool", "In", ("reserved",)))),
        PreferredSchedulingTerm(weight=50, preference=term(("gen", "Gt", ("3",))))))
    got = placed(state.place(job("j", pod_sets=one_set(gpus=4, affinity=prefer))))
    assert nodes_of(got) == ["b"]  # weight 50 beats 10; binpack alone would take `a`
    state.commit(got)
    got2 = placed(state.place(job("k", pod_sets=one_set(gpus=8, affinity=prefer))))
    assert nodes_of(got2) == ["c"]  # b has no room for 8: the next best score
    state.commit(got2)
    # Only unpreferred nodes left: a preference is not a requirement.
    assert nodes_of(placed(state.place(job("m", pod_sets=one_set(gpus=8, affinity=prefer))))) == ["a"]


def test_selection_is_honoured_by_the_reservation_search_and_the_what_if() -> None:
    state = ClusterState.from_nodes(labelled(a="spot", b="reserved"))
    state.commit(placed(state.place(job("on-b", pod_sets=one_set(selector={"pool": "reserved"})))))
    spec = job("j", pod_sets=one_set(selector={"pool": "reserved"}))
    # `a` is free, but only b's job ending lets the job start: the reservation is planned at its end.
    result = schedule_cycle(state, [PendingJob(spec)], [], now=0.0, timeline=[(100.0, "on-b")])
    assert result.reservations == {"j": 100.0}
    assert state.try_place_if_released(spec, ["on-b"]) is not None
    assert state.try_place(spec) is None


def test_selector_requirement_validation() -> None:
    with pytest.raises(ValidationError, match="needs at least one value"):
        NodeSelectorRequirement(key="pool", operator="In")
    with pytest.raises(ValidationError, match="takes no values"):
        NodeSelectorRequirement(key="pool", operator="Exists", values=("x",))
    with pytest.raises(ValidationError, match="exactly one integer"):
        NodeSelectorRequirement(key="gen", operator="Gt", values=("x",))
    with pytest.raises(ValidationError, match=r"may only name metadata\.name"):
        NodeSelectorTerm(match_fields=(NodeSelectorRequirement(key="spec.x", operator="Exists"),))
