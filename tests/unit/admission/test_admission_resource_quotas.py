"""Quotas beyond GPUs (issue 48, item 5): cpu_milli, memory_mib, pods and pool/<name> per queue, with the same
borrowing, lending and reclaim arithmetic as GPU models; a queue that sets none of them behaves as before."""

from __future__ import annotations

from services.core.admission import AdmissionState, Reason, Workload, admission_cycle
from services.core.admission.configcheck import check_change, inventory_of
from services.core.admission.governance import charges_cpu, submission_violation
from services.core.admission.summary import queue_summaries
from shared.domain import JobSpec, NodeSpec, PodSet
from tests.unit.admission.admission_core_builders import H100, config, job, queue, quota, submit

CPU, MEM, PODS = "cpu_milli", "memory_mib", "pods"


def cpu_job(job_id: str, q: str, pods: int, cpu_milli: int = 1000, memory_mib: int = 1024,
            priority: str = "normal") -> JobSpec:
    """A job asking no GPU: `pods` pods of `cpu_milli` and `memory_mib` each."""
    return job(job_id, q, priority=priority,
               pod_sets=(PodSet(count=pods, gpus_per_pod=0, cpu_milli=cpu_milli, memory_mib=memory_mib),))


def test_a_job_asking_no_gpu_takes_its_cpu_and_memory_quota() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8, CPU: 8000, MEM: 16384}, cohort=None), cohorts=()))
    submit(s, cpu_job("c0", "team-a", 4, 1500, 2048), 0)  # 6000m, 8192 MiB
    submit(s, cpu_job("c1", "team-a", 2, 1500, 1024), 1)  # 3000m more: 9000m > 8000m
    d = admission_cycle(s, 10.0)
    [a] = d.admitted
    assert a.job_id == "c0" and a.usage == {CPU: 6000, MEM: 8192} and a.flavors == {}
    st = d.pending["c1"]
    assert st.reason == Reason.WAITING_FOR_QUOTA
    assert "needs 3000 cpu_milli; team-a uses 6000/8000 cpu_milli" in st.message
    s.finish("c0")
    assert [x.job_id for x in admission_cycle(s, 20.0).admitted] == ["c1"]


def test_a_gpu_job_is_charged_its_gpus_and_every_pods_cpu() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8, CPU: 64000, PODS: 10}, cohort=None), cohorts=()))
    spec = job("g0", "team-a", pod_sets=(PodSet(name="w", count=2, gpus_per_pod=4, gpu_models=(H100,),
                                                cpu_milli=8000),
                                         PodSet(name="launcher", count=1, gpus_per_pod=0, cpu_milli=2000)))
    submit(s, spec, 0)
    [a] = admission_cycle(s, 1.0).admitted
    assert a.usage == {H100: 8, CPU: 18000, PODS: 3}
    assert a.flavors == {"w": H100}


def test_a_queue_without_cpu_quota_charges_none() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}, cohort=None), cohorts=()))
    submit(s, cpu_job("c0", "team-a", 1000, 64000), 0)
    [a] = admission_cycle(s, 1.0).admitted
    assert a.usage == {}


def test_borrowing_cpu_from_the_cohort_within_the_borrowing_limit() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8, CPU: 4000}),
                              queue("team-b", {H100: 8, CPU: quota(4000, borrowing_limit=2000)})))
    submit(s, cpu_job("b0", "team-b", 5, priority="low"), 0)  # 5000m: borrows 1000m of team-a's
    [a] = admission_cycle(s, 5.0).admitted
    assert a.job_id == "b0" and a.borrowing
    submit(s, cpu_job("b1", "team-b", 1, priority="low"), 1)  # 6000m: at nominal + limit
    submit(s, cpu_job("b2", "team-b", 1, priority="low"), 2)  # 7000m: over the borrowing limit
    d = admission_cycle(s, 10.0)
    assert [a.job_id for a in d.admitted] == ["b1"]
    assert s.usage("team-b") == {CPU: 6000} and s.borrowed("team-b") == {CPU: 2000}
    st = d.pending["b2"]
    assert st.reason == Reason.WAITING_FOR_QUOTA and "may borrow at most 2000" in st.message
    # team-a's own CPU job, within its nominal quota, asks for the part of its loan it lacks
    submit(s, cpu_job("a0", "team-a", 3), 20)
    d = admission_cycle(s, 30.0)
    assert not d.admitted and d.pending["a0"].reason == Reason.WAITING_FOR_RECLAIM
    assert [(r.preemptor, r.need, r.candidates) for r in d.reclaims] == [("a0", {CPU: 1000}, ("b1", "b0"))]


def test_lending_limit_keeps_memory_from_borrowers() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8, MEM: quota(8192, lending_limit=2048)}),
                              queue("team-b", {H100: 8, MEM: 4096})))
    submit(s, cpu_job("b0", "team-b", 1, memory_mib=6144), 0)  # 4096 own + 2048 lent
    assert [a.job_id for a in admission_cycle(s, 5.0).admitted] == ["b0"]
    submit(s, cpu_job("b1", "team-b", 1, memory_mib=1), 1)
    d = admission_cycle(s, 10.0)
    assert not d.admitted
    assert d.pending["b1"].reason == Reason.WAITING_FOR_BORROWABLE_QUOTA


def test_reclaim_of_borrowed_memory_returns_it_within_the_guarantee() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8, MEM: 8192}), queue("team-b", {H100: 8, MEM: 4096})))
    for i in range(3):
        submit(s, cpu_job(f"b{i}", "team-b", 1, memory_mib=4096, priority="low"), float(i))
        admission_cycle(s, 10.0 + i)
    assert s.usage("team-b") == {MEM: 12288} and s.borrowed("team-b") == {MEM: 8192}
    submit(s, cpu_job("a0", "team-a", 1, memory_mib=6144), 100)
    d = admission_cycle(s, 101.0)
    assert not d.admitted
    [r] = d.reclaims
    assert (r.preemptor, r.queue, r.need, r.reason) == ("a0", "team-a", {MEM: 6144}, Reason.RECLAIM_QUOTA)
    assert r.candidates == ("b2", "b1", "b0")
    assert d.pending["a0"].reason == Reason.WAITING_FOR_RECLAIM
    # the preemption service takes the two newest borrowers: team-a gets its nominal memory back
    s.finish("b2")
    s.finish("b1")
    [a] = admission_cycle(s, 110.0).admitted
    assert a.job_id == "a0" and not a.borrowing
    assert s.usage("team-b") == {MEM: 4096} and s.borrowed("team-b") == {}


def test_node_pool_quota_counts_the_gpus_that_select_the_pool() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 16, "pool/spot": 4}, cohort=None), cohorts=()))

    def pool_job(job_id: str, gpus: int, pool: str | None) -> JobSpec:
        return job(job_id, "team-a", pod_sets=(PodSet(count=1, gpus_per_pod=gpus, gpu_models=(H100,),
                                                      node_selector={"pool": pool} if pool else {}),))

    submit(s, pool_job("s0", 4, "spot"), 0)
    submit(s, pool_job("s1", 1, "spot"), 1)  # the pool's 4 GPUs are taken
    submit(s, pool_job("o0", 4, "on-demand"), 2)  # a pool the queue sets no quota for: not limited
    submit(s, pool_job("n0", 4, None), 3)  # selects no pool
    d = admission_cycle(s, 10.0)
    assert sorted(a.job_id for a in d.admitted) == ["n0", "o0", "s0"]
    assert {a.job_id: a.usage for a in d.admitted}["s0"] == {H100: 4, "pool/spot": 4}
    st = d.pending["s1"]
    assert st.reason == Reason.WAITING_FOR_QUOTA and "team-a uses 4/4 pool/spot" in st.message


def test_more_than_the_queue_can_ever_hold_is_refused_naming_the_resource() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8, PODS: quota(4, borrowing_limit=2)}),
                              queue("team-b", {H100: 8, PODS: 10})))
    rejection = s.submit(Workload(cpu_job("big", "team-a", 17), 0.0))
    assert rejection is not None and rejection.reason == Reason.EXCEEDS_LIMITS
    assert "asks 17 pods" in rejection.message and "pods at most 6" in rejection.message


def test_queues_view_shows_the_new_resources() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8, CPU: 4000}), queue("team-b", {H100: 8, CPU: 4000})))
    submit(s, cpu_job("b0", "team-b", 6), 0)
    admission_cycle(s, 1.0)
    rows = {r.queue: r for r in queue_summaries(s, 2.0)}
    assert rows["team-b"].nominal == {CPU: 4000, H100: 8}
    assert rows["team-b"].used == {CPU: 6000} and rows["team-b"].borrowed == {CPU: 2000}
    assert rows["team-a"].lent == {CPU: 2000}


def test_config_changes_recharge_the_request_of_pending_jobs() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}, cohort=None), cohorts=()))
    submit(s, cpu_job("c0", "team-a", 4), 0)
    s.set_config(config(queue("team-a", {H100: 8, CPU: 2000}, cohort=None), cohorts=()))
    d = admission_cycle(s, 1.0)
    assert not d.admitted and d.pending["c0"].reason == Reason.EXCEEDS_LIMITS
    assert "asks 4000 cpu_milli" in d.pending["c0"].message
    s.set_config(config(queue("team-a", {H100: 8, CPU: 4000}, cohort=None), cohorts=()))
    [a] = admission_cycle(s, 2.0).admitted
    assert a.usage == {CPU: 4000}


def _nodes(count: int, pool: str | None = None) -> list[NodeSpec]:
    return [NodeSpec(name=f"n-{pool}-{i}", gpus=8, gpu_model=H100, cpu_milli=64000, memory_mib=512000, rack="r",
                     block="b", labels={"pool": pool} if pool else {}) for i in range(count)]


def test_the_config_check_holds_cpu_memory_and_pool_guarantees_to_the_cluster() -> None:
    cluster = inventory_of(_nodes(2, "spot") + _nodes(2))  # 256000m, 2048000 MiB; pool spot: 16 GPUs
    old = config(queue("team-a", {H100: 8}, cohort=None), cohorts=())
    fits = check_change(old, config(queue("team-a", {H100: 8, CPU: 256000, MEM: 2048000, PODS: 10**6,
                                                     "pool/spot": 16}, cohort=None), cohorts=()), cluster, {})
    assert fits.refusals == () and fits.warnings == ()
    over = check_change(old, config(queue("team-a", {H100: 8, CPU: 256001, "pool/spot": 17, "pool/gone": 1},
                                          cohort=None), cohorts=()), cluster, {})
    assert over.refusals == (
        "guaranteed cpu_milli sums to 256001 but the cluster has 256000: guarantees cannot all be honoured at once",
        "quota for node pool gone, which no node carries (label pool; pools: spot)",
        "guaranteed pool/spot sums to 17 but the cluster has 16: guarantees cannot all be honoured at once")


def test_a_job_asking_no_gpu_is_taken_only_by_a_queue_with_a_cpu_or_memory_quota() -> None:
    cfg = config(queue("cpu-team", {H100: 8, MEM: 1024}, cohort=None), queue("gpu-team", {H100: 8}, cohort=None),
                 cohorts=())
    spec = cpu_job("c0", "cpu-team", 1)
    policy = cfg.governance.for_team("cpu-team")
    assert charges_cpu(cfg, "cpu-team") and not charges_cpu(cfg, "gpu-team") and not charges_cpu(cfg, "nope")
    assert submission_violation(spec, policy, cpu_queue=charges_cpu(cfg, "cpu-team")) is None
    refused = submission_violation(spec, policy, cpu_queue=charges_cpu(cfg, "gpu-team"))
    assert refused is not None and refused.reason == "NoGpuRequested" and "cpu_milli, memory_mib" in refused.message
