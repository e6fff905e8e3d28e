"""Node pools as flavors (issue 48, items 4 and 5): a job that selects no node pool gets one from its queue's
`pools`, in order, by Kueue's flavor fungibility (a fit without borrowing first, then borrowing, then preemption,
as `pool_fungibility` says); it is charged that pool's `pool/<name>` quota and placed on that pool's nodes only."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pydantic import ValidationError

from services.api.readmodel import explain_lines
from services.core.admission import AdmissionState, Reason, admission_cycle
from services.core.admission.configcheck import check_change, inventory_of
from services.core.pipeline.pipeline import waiting_job
from services.core.scheduler import ClusterState, Placement
from shared.config import QueueConfig
from shared.domain import JobSpec, NodeSpec, PodSet
from tests.unit.admission.admission_core_builders import H100, config, job, queue, submit
from tests.unit.scheduler.scheduler_builders import nodes

PA, PB = "pool/a", "pool/b"


def pooled(q: dict[str, Any], pools: tuple[str, ...] = ("a", "b"), **fungibility: str) -> dict[str, Any]:
    return q | {"pools": list(pools)} | ({"pool_fungibility": fungibility} if fungibility else {})


def gpu_job(job_id: str, q: str, gpus: int, *, pool: str | None = None, priority: str = "normal") -> JobSpec:
    return job(job_id, q, priority=priority, pod_sets=(
        PodSet(name="w", count=1, gpus_per_pod=gpus, gpu_models=(H100,),
               node_selector={"pool": pool} if pool else {}),))


def test_pools_are_tried_in_order_and_the_chosen_pool_is_charged_and_selected() -> None:
    s = AdmissionState(config(pooled(queue("team-a", {H100: 16, PA: 4, PB: 8}, cohort=None)), cohorts=()))
    submit(s, gpu_job("j0", "team-a", 4), 0)
    submit(s, gpu_job("j1", "team-a", 4), 1)  # pool a is full: pool b
    submit(s, gpu_job("j2", "team-a", 8), 2)  # neither has 8 left: waits on pool b, the one that can hold it
    d = admission_cycle(s, 10.0)
    got = {a.job_id: a for a in d.admitted}
    assert (got["j0"].pool, got["j0"].usage) == ("a", {H100: 4, PA: 4})
    assert (got["j1"].pool, got["j1"].usage) == ("b", {H100: 4, PB: 4})
    assert got["j0"].spec.pod_sets[0].selector == {"pool": "a"}  # what the scheduler places by
    assert got["j1"].spec.pod_sets[0].selector == {"pool": "b"}
    st = d.pending["j2"]
    assert st.reason == Reason.WAITING_FOR_QUOTA
    assert st.message == ("needs 8 pool/b; team-a uses 4/8 pool/b and has no cohort to borrow from; on node pool "
                          "b (queue team-a tries pools a, b in that order)")
    s.finish("j0")
    assert not admission_cycle(s, 20.0).admitted  # pool a can never hold 8
    s.finish("j1")
    [a] = admission_cycle(s, 30.0).admitted
    assert (a.job_id, a.pool, a.usage) == ("j2", "b", {H100: 8, PB: 8})


def test_a_job_that_selects_a_pool_itself_is_not_given_another() -> None:
    s = AdmissionState(config(pooled(queue("team-a", {H100: 16, PA: 4, PB: 8}, cohort=None)), cohorts=()))
    submit(s, gpu_job("j0", "team-a", 4, pool="b"), 0)
    submit(s, gpu_job("j1", "team-a", 4, pool="a"), 1)
    submit(s, gpu_job("j2", "team-a", 4, pool="a"), 2)  # pool a is full: waits, never moved to b's free 4
    d = admission_cycle(s, 10.0)
    got = {a.job_id: a for a in d.admitted}
    assert sorted(got) == ["j0", "j1"]
    assert (got["j0"].pool, got["j0"].usage) == (None, {H100: 4, PB: 4})
    assert d.pending["j2"].reason == Reason.WAITING_FOR_QUOTA and "pool/a" in d.pending["j2"].message


def lender_config(**fungibility: str) -> AdmissionState:
    """team-a has 2 GPUs of pool a (team-b lends it 6 more) and 8 of pool b; team-b uses none."""
    return AdmissionState(config(
        pooled(queue("team-a", {H100: 16, PA: 2, PB: 8}), **fungibility),
        queue("team-b", {H100: 16, PA: 6, PB: 0})))


def test_a_pool_that_fits_without_borrowing_is_preferred_to_an_earlier_one_that_borrows() -> None:
    s = lender_config()
    submit(s, gpu_job("j0", "team-a", 4, priority="low"), 0)
    [a] = admission_cycle(s, 10.0).admitted
    assert (a.pool, a.borrowing, a.usage) == ("b", False, {H100: 4, PB: 4})


def test_when_can_borrow_borrow_takes_the_first_pool_that_fits_by_borrowing() -> None:
    s = lender_config(when_can_borrow="Borrow")
    submit(s, gpu_job("j0", "team-a", 4, priority="low"), 0)
    [a] = admission_cycle(s, 10.0).admitted
    assert (a.pool, a.borrowing, a.usage) == ("a", True, {H100: 4, PA: 4})


def test_when_no_pool_fits_within_nominal_the_first_that_fits_by_borrowing_is_taken() -> None:
    s = lender_config()
    submit(s, gpu_job("j0", "team-a", 8, priority="low"), 0)  # takes pool b's 8
    submit(s, gpu_job("j1", "team-a", 4, priority="low"), 1)  # pool a: 2 own + 2 borrowed
    d = admission_cycle(s, 10.0)
    got = {a.job_id: a for a in d.admitted}
    assert (got["j0"].pool, got["j0"].borrowing) == ("b", False)
    assert (got["j1"].pool, got["j1"].borrowing, got["j1"].usage) == ("a", True, {H100: 4, PA: 4})


def preempt_config(**fungibility: str) -> AdmissionState:
    s = AdmissionState(config(pooled(queue("team-a", {H100: 16, PA: 4, PB: 8}, cohort=None), **fungibility),
                              cohorts=()))
    submit(s, gpu_job("low", "team-a", 4, pool="a", priority="low"), 0)  # fills pool a
    assert [a.job_id for a in admission_cycle(s, 1.0).admitted] == ["low"]
    submit(s, gpu_job("high", "team-a", 4, priority="high"), 2)
    return s


def test_a_later_pool_that_fits_is_taken_before_preempting_in_an_earlier_one() -> None:
    s = preempt_config()
    [a] = admission_cycle(s, 10.0).admitted
    assert (a.job_id, a.pool) == ("high", "b")


def test_when_can_preempt_preempt_waits_on_the_first_pool_where_preemption_makes_room() -> None:
    s = preempt_config(when_can_preempt="Preempt")
    d = admission_cycle(s, 10.0)
    assert not d.admitted
    st = d.pending["high"]
    assert "on node pool a" in st.message
    s.finish("low")  # the within-queue preemption done: pool a has room again
    [a] = admission_cycle(s, 20.0).admitted
    assert (a.job_id, a.pool, a.usage) == ("high", "a", {H100: 4, PA: 4})


def test_when_can_preempt_preempt_passes_a_pool_where_no_one_could_be_preempted() -> None:
    s = AdmissionState(config(pooled(queue("team-a", {H100: 16, PA: 4, PB: 8}, cohort=None),
                                     when_can_preempt="Preempt"), cohorts=()))
    submit(s, gpu_job("same", "team-a", 4, pool="a", priority="high"), 0)  # fills pool a; never preempted by a peer
    assert [a.job_id for a in admission_cycle(s, 1.0).admitted] == ["same"]
    submit(s, gpu_job("high", "team-a", 4, priority="high"), 2)
    [a] = admission_cycle(s, 10.0).admitted
    assert (a.job_id, a.pool) == ("high", "b")


def test_a_restored_admission_keeps_its_pool_charge() -> None:
    s = AdmissionState(config(pooled(queue("team-a", {H100: 16, PA: 4, PB: 8}, cohort=None)), cohorts=()))
    submit(s, gpu_job("j0", "team-a", 4), 0)
    [a] = admission_cycle(s, 10.0).admitted
    s2 = AdmissionState(s.config)
    s2.restore_admitted(a)
    assert s2.usage("team-a") == {H100: 4, PA: 4}
    submit(s2, gpu_job("j1", "team-a", 4), 11)
    [b] = admission_cycle(s2, 20.0).admitted
    assert b.pool == "b"


def pool_nodes() -> list[NodeSpec]:
    out = []
    for name, pool in (("n-a", "a"), ("n-b", "b")):
        (spec,) = nodes(1, prefix=name)
        out.append(spec.model_copy(update={"name": name, "labels": {"pool": pool, "kubernetes.io/hostname": name}}))
    return out


def test_the_scheduler_places_the_job_only_on_its_pools_nodes() -> None:
    s = AdmissionState(config(pooled(queue("team-a", {H100: 16, PA: 0, PB: 8}, cohort=None)), cohorts=()))
    submit(s, gpu_job("j0", "team-a", 4), 0)  # pool a has no quota left: b
    [a] = admission_cycle(s, 10.0).admitted
    cluster = ClusterState.from_nodes(pool_nodes())  # binpack alone would take n-a, the first by rank
    w = waiting_job(s.config, a)
    got = cluster.place(w.spec, w.allowed_models)
    assert isinstance(got, Placement)
    assert {b.node for b in got.bindings} == {"n-b"}


@pytest.mark.parametrize(("fields", "message"), [
    ({"pools": ["a", "a"]}, "pools: a listed twice"),
    ({"pools": ["not a label"]}, "'not a label' is no value of the nodes' `pool` label"),
    ({"pools": []}, "list at least one node pool"),
    ({"pool_fungibility": {}}, "pool_fungibility is set but pools is not"),
    ({"pools": ["a"], "pool_fungibility": {"when_can_borrow": "Preempt"}}, "when_can_borrow is Borrow or"),
    ({"pools": ["a"], "pool_fungibility": {"when_can_preempt": "Borrow"}}, "when_can_preempt is Preempt or"),
    ({"pools": ["a"], "pool_fungibility": {"when_can_borow": "Borrow"}}, "when_can_borow"),
    ({"spot_pools": ["a"]}, "spot_pools is set but pools is not"),
    ({"pools": ["a", "b"], "spot_pools": ["c"]}, "spot_pools c not in its pools"),
    ({"pools": ["a"], "spot_pools": ["a"]}, "every pool is a spot pool"),
])
def test_pools_configuration_is_checked(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(")):
        QueueConfig(name="team-a", **fields)


def test_a_queue_without_pools_admits_as_before() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 16, PA: 4}, cohort=None), cohorts=()))
    submit(s, gpu_job("j0", "team-a", 8), 0)
    [a] = admission_cycle(s, 10.0).admitted
    assert (a.pool, a.usage, a.spec.pod_sets[0].selector) == (None, {H100: 8}, {})


def test_a_pool_without_a_quota_key_is_bounded_by_the_gpu_quota_alone() -> None:
    # pool a's request equals the job's own (no pool/a key): many such jobs of a deep queue share its fit verdict,
    # and each admitted one still records and selects its pool
    s = AdmissionState(config(pooled(queue("team-a", {H100: 12, PB: 8}, cohort=None)), cohorts=()))
    for i in range(5):
        submit(s, gpu_job(f"j{i}", "team-a", 4), i)
    d = admission_cycle(s, 10.0)
    assert [(a.job_id, a.pool, a.usage) for a in d.admitted] == [(f"j{i}", "a", {H100: 4}) for i in range(3)]
    assert all(a.spec.pod_sets[0].selector == {"pool": "a"} for a in d.admitted)
    for j in ("j3", "j4"):  # the same verdict, each naming the pool it waits on
        assert d.pending[j].reason == Reason.WAITING_FOR_QUOTA and "on node pool a (queue" in d.pending[j].message


def test_an_admission_restored_from_a_store_that_kept_the_submitted_spec_selects_its_pool_again() -> None:
    # the admission service's row keeps the spec as submitted (a requeue starts from it, free to choose again)
    s = AdmissionState(config(pooled(queue("team-a", {H100: 16, PA: 4, PB: 8}, cohort=None)), cohorts=()))
    submit(s, gpu_job("j0", "team-a", 4), 0)
    submit(s, gpu_job("j1", "team-a", 4), 1)
    d = admission_cycle(s, 10.0)
    s2 = AdmissionState(s.config)
    for a in d.admitted:
        s2.restore_admitted(replace(a, spec=gpu_job(a.job_id, "team-a", 4), pool=None))
    assert {j: (a.pool, a.spec.pod_sets[0].selector) for j, a in s2.admitted.items()} == {
        "j0": ("a", {"pool": "a"}), "j1": ("b", {"pool": "b"})}
    assert s2.usage("team-a") == {H100: 8, PA: 4, PB: 4}


def test_a_spot_pool_is_chosen_for_preemptible_jobs_only() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 16, "pool/on-demand": 4, "pool/spot": 8}, cohort=None)
                              | {"pools": ["on-demand", "spot"], "spot_pools": ["spot"]}, cohorts=()))
    submit(s, gpu_job("p0", "team-a", 4, priority="production"), 0)  # never preempted: never on spot
    submit(s, gpu_job("p1", "team-a", 4, priority="production"), 1)
    submit(s, gpu_job("n0", "team-a", 4), 2)  # normal: preemptible
    d = admission_cycle(s, 10.0)
    assert {a.job_id: a.pool for a in d.admitted} == {"p0": "on-demand", "n0": "spot"}
    st = d.pending["p1"]  # spot has room, but not for it
    assert st.reason == Reason.WAITING_FOR_QUOTA
    assert "on node pool on-demand (queue team-a tries pools on-demand in that order)" in st.message
    s.finish("p0")
    [a] = admission_cycle(s, 20.0).admitted
    assert (a.job_id, a.pool) == ("p1", "on-demand")


def test_the_config_check_refuses_a_pool_no_node_carries() -> None:
    cluster = inventory_of([NodeSpec(name="n-a", gpus=8, gpu_model=H100, cpu_milli=64000, memory_mib=512000,
                                     rack="r", block="b", labels={"pool": "a"})])
    old = config(queue("team-a", {H100: 8}, cohort=None), cohorts=())
    fine = check_change(old, config(pooled(queue("team-a", {H100: 8}, cohort=None), ("a",)), cohorts=()), cluster, {})
    assert fine.refusals == () and fine.warnings == ()
    new = config(pooled(queue("team-a", {H100: 8}, cohort=None), ("a", "gone")), cohorts=())
    assert check_change(old, new, cluster, {}).refusals == (
        "queue team-a lists node pool gone under pools, which no node carries (label pool; pools: a)",)
    # listed already: the nodes went under it, a warning
    assert check_change(new, new, cluster, {}).warnings == (
        "queue team-a lists node pool gone under pools, which no node carries (label pool; pools: a)",)


def test_explain_says_what_was_charged_and_on_which_pool() -> None:
    spec = {"job_id": "j", "pod_sets": [{"count": 1, "gpus_per_pod": 4}], "priority_class": "normal",
            "max_runtime_s": 7200}
    row = {"job_id": "j", "team": "a", "queue": "a", "state": "running", "spec": spec, "submitted_at": 0.0,
           "admitted_at": 1.0, "placed_at": 2.0, "nodes": ["n-b"], "racks_spanned": 1, "blocks_spanned": 1,
           "usage": {H100: 4, PB: 4, "cpu_milli": 8000}}
    assert "  quota charged: H100-80GB:4, cpu:8, pool/b:4; on node pool b" in explain_lines(row, 10.0)
