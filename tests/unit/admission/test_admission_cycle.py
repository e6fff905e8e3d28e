"""The admission cycle: quota arithmetic, flavor choice, ordering, queueing strategies, limits, statuses."""

from __future__ import annotations

from services.core.admission import AdmissionState, Reason, Workload, admission_cycle
from shared.domain import PodSet
from tests.unit.admission.admission_core_builders import A100, H100, config, job, queue, quota, submit, submit_many


def two_teams(**kw) -> AdmissionState:  # type: ignore[no-untyped-def]
    return AdmissionState(config(queue("team-a", {H100: 8}, **kw), queue("team-b", {H100: 8}, **kw)))


# ---------------------------------------------------------------- fit and borrowing


def test_fits_nominal_then_borrows_idle_cohort_quota() -> None:
    s = two_teams()
    submit_many(s, "team-a", 3, 4)
    d = admission_cycle(s, 100.0)
    assert [(a.job_id, a.borrowing) for a in d.admitted] == [
        ("team-a-0", False), ("team-a-1", False), ("team-a-2", True)]
    a = d.admitted[0]
    assert a.flavors == {"main": H100} and a.usage == {H100: 4} and a.admitted_at == 100.0
    assert a.submitted_at == 0.0
    assert s.usage("team-a") == {H100: 12} and s.borrowed("team-a") == {H100: 4}
    assert set(s.admitted) == {"team-a-0", "team-a-1", "team-a-2"} and not s.pending


def test_borrowing_stops_when_cohort_has_nothing_lendable() -> None:
    s = two_teams()
    submit_many(s, "team-a", 5, 4)
    d = admission_cycle(s, 0.0)
    assert len(d.admitted) == 4
    st = d.pending["team-a-4"]
    assert st.reason == Reason.WAITING_FOR_BORROWABLE_QUOTA
    assert "team-a uses 16/8 H100-80GB" in st.message and "cohort research has 0 lendable" in st.message


def test_borrowing_limit_caps_usage() -> None:
    s = AdmissionState(config(queue("team-a", {H100: quota(8, borrowing_limit=2)}), queue("team-b", {H100: 8})))
    submit_many(s, "team-a", 6, 2)
    d = admission_cycle(s, 0.0)
    assert len(d.admitted) == 5 and s.usage("team-a") == {H100: 10}
    st = d.pending["team-a-5"]
    assert st.reason == Reason.WAITING_FOR_QUOTA and "may borrow at most 2" in st.message


def test_lending_limit_caps_what_others_borrow() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: quota(8, lending_limit=3)})))
    submit_many(s, "team-a", 20, 1)
    admission_cycle(s, 0.0)
    assert s.usage("team-a") == {H100: 11}  # 8 own + 3 lendable from team-b
    # team-b's guaranteed 5 are always there without any reclaim, and the 3 it lent come back by reclaim
    submit_many(s, "team-b", 8, 1, priority="high")
    d = admission_cycle(s, 1.0)
    assert len(d.admitted) == 5
    assert d.reclaims and d.reclaims[0].need == {H100: 1}


def test_queue_without_cohort_never_borrows() -> None:
    s = AdmissionState(config(queue("solo", {H100: 4}, cohort=None), queue("rich", {H100: 100})))
    submit_many(s, "solo", 3, 2)
    d = admission_cycle(s, 0.0)
    assert len(d.admitted) == 2
    assert d.pending["solo-2"].reason == Reason.WAITING_FOR_QUOTA
    assert "no cohort" in d.pending["solo-2"].message


def test_admits_a_deep_queue_in_one_cycle() -> None:
    """Unlike Kueue's one head per queue per cycle: a cycle drains everything that fits."""
    s = AdmissionState(config(queue("team-a", {H100: 500})))
    submit_many(s, "team-a", 400, 1)
    d = admission_cycle(s, 0.0)
    assert len(d.admitted) == 400 and not d.pending


# ---------------------------------------------------------------- flavors


def test_prefers_a_flavor_without_borrowing() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 0, A100: 4}), queue("team-b", {H100: 8, A100: 0})))
    submit_many(s, "team-a", 3, 2, models=(H100, A100))
    d = admission_cycle(s, 0.0)
    assert [(a.flavors["main"], a.borrowing) for a in d.admitted] == [
        (A100, False), (A100, False), (H100, True)]


def test_first_model_in_any_of_order_when_both_fit() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8, A100: 8})))
    submit(s, job("j1", "team-a", 2, models=(A100, H100)))
    submit(s, job("j2", "team-a", 2, models=(H100, A100)), 1)
    d = admission_cycle(s, 0.0)
    assert [a.flavors["main"] for a in d.admitted] == [A100, H100]


def test_pod_sets_add_up_on_one_model_and_cpu_pod_sets_take_no_quota() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8, A100: 8}, cohort=None)))
    spec = job("j1", "team-a", pod_sets=(
        PodSet(name="workers", count=2, gpus_per_pod=3, gpu_models=(H100, A100)),
        PodSet(name="more", count=1, gpus_per_pod=4, gpu_models=(H100, A100)),
        PodSet(name="launcher", count=1, gpus_per_pod=0),
    ))
    submit(s, spec)
    [a] = admission_cycle(s, 0.0).admitted
    # 6 H100 for workers leaves 2, so the 4-GPU pod set falls through to A100
    assert a.flavors == {"workers": H100, "more": A100}
    assert a.usage == {H100: 6, A100: 4}


def test_mig_pods_take_slices_of_the_mig_resource() -> None:
    s = AdmissionState(config(queue("team-a", {"A100-40GB:1g.5gb": 14, "A100-40GB": 2}, cohort=None)))
    submit(s, job("mig", "team-a", count=10, models=("A100-40GB",), mig="1g.5gb"))
    submit(s, job("mig2", "team-a", count=5, models=("A100-40GB",), mig="1g.5gb"), 1)
    d = admission_cycle(s, 0.0)
    assert [(a.job_id, a.usage) for a in d.admitted] == [("mig", {"A100-40GB:1g.5gb": 10})]
    assert d.admitted[0].flavors == {"main": "A100-40GB"}
    assert d.pending["mig2"].reason == Reason.WAITING_FOR_QUOTA


def test_mig_without_a_slice_quota_is_charged_whole_gpus() -> None:
    s = AdmissionState(config(queue("team-a", {"A100-40GB": 2}, cohort=None)))
    submit(s, job("mig", "team-a", count=2, models=("A100-40GB",), mig="2g.10gb"))
    submit(s, job("mig2", "team-a", count=1, models=("A100-40GB",), mig="2g.10gb"), 1)
    d = admission_cycle(s, 0.0)
    assert [(a.job_id, a.usage) for a in d.admitted] == [("mig", {"A100-40GB": 2})]


# ---------------------------------------------------------------- ordering


def test_priority_first_then_submit_time_across_queues() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 4}), queue("team-b", {H100: 4})))
    submit(s, job("old-low", "team-a", 4, priority="low"), 0)
    submit(s, job("new-high", "team-b", 4, priority="high"), 10)
    submit(s, job("mid-normal", "team-a", 4), 5)
    d = admission_cycle(s, 20.0)
    assert [a.job_id for a in d.admitted] == ["new-high", "mid-normal"]
    assert d.pending["old-low"].reason == Reason.WAITING_FOR_BORROWABLE_QUOTA


def test_older_first_within_a_priority() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 2}, cohort=None)))
    submit(s, job("b", "team-a", 1), 5)
    submit(s, job("a", "team-a", 1), 7)
    submit(s, job("c", "team-a", 1), 1)
    d = admission_cycle(s, 10.0)
    assert [a.job_id for a in d.admitted] == ["c", "b"]


def test_non_borrowing_queue_goes_before_borrowing_queue_at_equal_priority() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 4}), queue("team-b", {H100: 4}), queue("idle", {H100: 4})))
    submit_many(s, "team-a", 4, 4, t0=0)  # older, but beyond its nominal after the first
    submit(s, job("b-0", "team-b", 4), 100)
    d = admission_cycle(s, 200.0)
    order = [a.job_id for a in d.admitted]
    assert order[:2] == ["team-a-0", "b-0"]  # b's non-borrowing fit beats a's older borrowing one
    assert order[2:] == ["team-a-1"]


def test_requeued_job_keeps_its_place() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 1}, cohort=None)))
    submit(s, job("first", "team-a"), 0)
    admission_cycle(s, 1.0)
    submit(s, job("second", "team-a"), 2)
    s.requeue(Workload(job("first", "team-a"), 0))  # preempted
    assert "first" not in s.admitted and s.usage("team-a") == {}
    d = admission_cycle(s, 3.0)
    assert [a.job_id for a in d.admitted] == ["first"]
    assert d.pending["second"].position_in_queue == 1


# ---------------------------------------------------------------- queueing strategies and limits


def test_strict_fifo_head_blocks_the_queue() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 4}, cohort=None, strategy="StrictFIFO")))
    submit(s, job("small-0", "team-a", 2), 0)
    submit(s, job("big", "team-a", 4), 1)
    submit(s, job("small-1", "team-a", 2), 2)
    d = admission_cycle(s, 3.0)
    assert [a.job_id for a in d.admitted] == ["small-0"]
    assert d.pending["big"].reason == Reason.WAITING_FOR_QUOTA
    assert d.pending["small-1"].reason == Reason.WAITING_IN_STRICT_FIFO
    assert "big" in d.pending["small-1"].message


def test_best_effort_fifo_lets_smaller_jobs_pass() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 4}, cohort=None)))
    submit(s, job("small-0", "team-a", 2), 0)
    submit(s, job("big", "team-a", 4), 1)
    submit(s, job("small-1", "team-a", 2), 2)
    d = admission_cycle(s, 3.0)
    assert [a.job_id for a in d.admitted] == ["small-0", "small-1"]
    assert d.pending["big"].reason == Reason.WAITING_FOR_QUOTA


def test_max_running_jobs() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}, cohort=None, max_running_jobs=2)))
    submit_many(s, "team-a", 4, 1)
    d = admission_cycle(s, 0.0)
    assert len(d.admitted) == 2
    assert {st.reason for st in d.pending.values()} == {Reason.WAITING_FOR_MAX_RUNNING_JOBS}
    assert "2/2" in d.pending["team-a-2"].message
    s.finish("team-a-0")
    d = admission_cycle(s, 1.0)
    assert [a.job_id for a in d.admitted] == ["team-a-2"]


def test_capacity_caps_admission_and_missing_model_has_none_free() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 16, A100: 16}, cohort=None)))
    submit_many(s, "team-a", 4, 2)
    submit(s, job("a100", "team-a", 1, models=(A100,)), 10)
    d = admission_cycle(s, 0.0, capacity={H100: 5})
    assert [a.job_id for a in d.admitted] == ["team-a-0", "team-a-1"]
    assert d.pending["team-a-2"].reason == Reason.WAITING_FOR_CAPACITY
    assert "the cluster has 1 H100-80GB free" in d.pending["team-a-2"].message
    assert d.pending["a100"].reason == Reason.WAITING_FOR_CAPACITY


def test_capacity_caps_mig_slices_only_when_their_key_is_given() -> None:
    s = AdmissionState(config(queue("team-a", {"A100-40GB:1g.5gb": 14}, cohort=None)))
    submit(s, job("m0", "team-a", count=4, models=("A100-40GB",), mig="1g.5gb"))
    submit(s, job("m1", "team-a", count=4, models=("A100-40GB",), mig="1g.5gb"), 1)
    assert len(admission_cycle(s.copy(), 0.0, capacity={"A100-40GB": 0}).admitted) == 2
    d = admission_cycle(s, 0.0, capacity={"A100-40GB:1g.5gb": 5})
    assert [a.job_id for a in d.admitted] == ["m0"]
    assert d.pending["m1"].reason == Reason.WAITING_FOR_CAPACITY


def test_max_admissions_stops_the_cycle() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 16}), queue("team-b", {H100: 16})))
    submit_many(s, "team-a", 5, 1)
    submit_many(s, "team-b", 5, 1, t0=0.5)
    d = admission_cycle(s, 0.0, max_admissions=3)
    assert [a.job_id for a in d.admitted] == ["team-a-0", "team-b-0", "team-a-1"]
    assert len(d.pending) == 7
    assert {st.reason for st in d.pending.values()} == {Reason.WAITING_FOR_NEXT_CYCLE}


def test_explain_false_admits_the_same_and_skips_statuses() -> None:
    def build() -> AdmissionState:
        s = AdmissionState(config(queue("team-a", {H100: 5}), queue("team-b", {H100: 3})))
        submit_many(s, "team-a", 10, 1)
        return s

    full, quick = admission_cycle(build(), 0.0), admission_cycle(build(), 0.0, explain=False)
    assert full.admitted == quick.admitted and full.reclaims == quick.reclaims
    assert full.pending and not quick.pending


# ---------------------------------------------------------------- statuses


def test_every_pending_job_has_a_status_and_positions() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 1}), queue("team-b", {H100: 1})))
    submit(s, job("a0", "team-a"), 0)
    submit(s, job("b0", "team-b"), 1)
    submit(s, job("a1", "team-a"), 2)
    submit(s, job("b1", "team-b", priority="high"), 3)
    submit(s, job("a2", "team-a"), 4)
    d = admission_cycle(s, 10.0)
    assert sorted(a.job_id for a in d.admitted) == ["a0", "b1"]
    assert set(d.pending) == {"b0", "a1", "a2"}
    got = {j: (st.queue, st.position_in_queue, st.position_in_cohort) for j, st in d.pending.items()}
    assert got == {"b0": ("team-b", 1, 1), "a1": ("team-a", 1, 2), "a2": ("team-a", 2, 3)}
    assert all(st.reason and st.message for st in d.pending.values())


def test_cycle_is_deterministic() -> None:
    def run() -> tuple:
        s = AdmissionState(config(queue("team-a", {H100: 5, A100: 2}), queue("team-b", {H100: 3}, weight=2),
                                  queue("team-c", {A100: 6})))
        for i in range(30):
            q = ("team-a", "team-b", "team-c")[i % 3]
            submit(s, job(f"j{i}", q, 1 + i % 3, models=(H100, A100)), float(i // 4))
        d = admission_cycle(s, 50.0)
        return (d.admitted, d.pending, d.reclaims)

    assert run() == run()
