"""A reclaim of borrowed CPU (issue 48 item 5): the preemption service counts what admission charged a running job
beyond GPUs (`running_job` in services/preemption/store.py), so the borrowers that hold the CPU are found, and only
as many as the need asks (the lender gets its guarantee back, the borrower keeps its own)."""

from __future__ import annotations

from services.admission.readmodel import AdmissionFact
from services.core.preemption import RECLAIM, Preemptor, priority_of, select_victims
from services.core.scheduler import ClusterState, Placement
from services.preemption.app import _preemptor
from services.preemption.store import running_job
from shared.config import parse_queues
from shared.domain import JobSpec, PodSet
from shared.events import PreemptionReason, PreemptionRequested
from tests.unit.preemption.builders import MODEL, nodes

NOW = 100_000.0
CONFIG = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [{"name": q, "cohort": "research", "quotas": {MODEL: {"nominal": 8}, "cpu_milli": {"nominal": 4000}}}
               for q in ("team-a", "team-b")],
    "policy": {"protection_window_s": 0, "max_victim_loss_s": None},
})


def cpu_spec(job_id: str, queue: str, klass: str = "low") -> JobSpec:
    return JobSpec(job_id=job_id, team=queue, queue=queue, priority_class=klass,
                   pod_sets=(PodSet(count=2, gpus_per_pod=0, cpu_milli=1000, memory_mib=0),))


def test_the_cpu_borrowers_are_found_and_only_what_the_need_asks_is_taken() -> None:
    cluster = ClusterState.from_nodes(nodes(1))
    by_name = {n.name: n for n in nodes(1)}
    running = []
    for i in range(3):  # team-b runs 6 CPUs on a nominal 4: it borrows 2 of team-a's
        s = cpu_spec(f"b{i}", "team-b")
        placement = cluster.place(s)
        assert isinstance(placement, Placement)
        cluster.commit(placement)
        running.append(running_job(s, list(placement.bindings), by_name, CONFIG, NOW - 1000 * (3 - i), None))
    assert [j.usage for j in running] == [{"cpu_milli": 2000}] * 3
    boss = cpu_spec("a0", "team-a", "normal")
    preemptor = Preemptor(job_id="a0", queue="team-a", priority=priority_of(CONFIG, boss)[0], kind=boss.kind,
                          spec=boss, reason=RECLAIM, need={"cpu_milli": 2000})
    sel = select_victims(preemptor, running, cluster, CONFIG, NOW)
    assert sel.victims == ("b2",)  # the newest: least work lost; team-b keeps its nominal 4 CPUs


def test_a_gpu_job_short_of_cpu_only_may_still_run_on_its_own_models() -> None:
    """The preemption service's preemptor for a reclaim whose need names only CPU: no GPU model is derived from
    `cpu_milli` (which would leave the GPU pods no node to fit on, so no victim), it keeps its own models."""
    cluster = ClusterState.from_nodes(nodes(1))
    by_name = {n.name: n for n in nodes(1)}
    running = []
    for i in range(3):
        s = cpu_spec(f"b{i}", "team-b")
        placement = cluster.place(s)
        assert isinstance(placement, Placement)
        cluster.commit(placement)
        running.append(running_job(s, list(placement.bindings), by_name, CONFIG, NOW - 1000 * (3 - i), None))
    boss = JobSpec(job_id="a0", team="team-a", queue="team-a", priority_class="normal",
                   pod_sets=(PodSet(count=1, gpus_per_pod=4, gpu_models=(MODEL,), cpu_milli=4000, memory_mib=0),))
    fact = AdmissionFact(job_id="a0", queue="team-a", spec=boss, status="pending", flavors={})
    ask = PreemptionRequested(preemptor="a0", queue="team-a", reason=PreemptionReason.RECLAIM,
                              need={"cpu_milli": 2000}, candidates=("b2", "b1", "b0"))
    preemptor = _preemptor(CONFIG, fact, ask)
    assert preemptor.allowed_models == ()
    assert select_victims(preemptor, running, cluster, CONFIG, NOW).victims == ("b2",)


def test_a_queue_borrowing_cpu_within_its_gpu_quota_gives_the_cpu_back() -> None:
    """The guarantee of a victim's queue is measured on the resources the reclaim needs: team-b borrows CPU while
    it uses 2 of its 8 GPUs, and its newest job is taken for the lender's CPU (Kueue reclaims on the preempting
    resources only); before, its GPUs below nominal kept every job, and the lender never got its CPU back."""
    cluster = ClusterState.from_nodes(nodes(1))
    by_name = {n.name: n for n in nodes(1)}
    running = []
    for i in range(2):  # 1 GPU and 3 CPUs each: 6 CPUs on a nominal 4
        s = JobSpec(job_id=f"b{i}", team="team-b", queue="team-b", priority_class="low",
                    pod_sets=(PodSet(count=1, gpus_per_pod=1, gpu_models=(MODEL,), cpu_milli=3000, memory_mib=0),))
        placement = cluster.place(s)
        assert isinstance(placement, Placement)
        cluster.commit(placement)
        running.append(running_job(s, list(placement.bindings), by_name, CONFIG, NOW - 1000 * (2 - i), None))
    assert running[0].usage == {MODEL: 1, "cpu_milli": 3000}
    boss = cpu_spec("a0", "team-a", "normal")
    preemptor = Preemptor(job_id="a0", queue="team-a", priority=priority_of(CONFIG, boss)[0], kind=boss.kind,
                          spec=boss, reason=RECLAIM, need={"cpu_milli": 2000})
    assert select_victims(preemptor, running, cluster, CONFIG, NOW).victims == ("b1",)
