"""Elastic jobs in the decision loop (services/core/pipeline/elastic.py): start at what fits, quota charges the pods
that run, grow into idle GPUs in order of fair share, shrink before anyone is preempted."""

from __future__ import annotations

import pytest

from services.core.admission import AdmissionState, Workload
from services.core.pipeline import Decision, PreemptionStage, ServiceAsks, VictimChooser, WaitingJob, decide
from services.core.pipeline.elastic import GROW, SHRINK
from services.core.scheduler import ClusterState
from services.core.scheduler import RunningJob as Believed
from shared.config import QueuesConfig, parse_queues
from shared.domain import JobSpec, PodSet
from tests.unit.preemption.builders import MODEL, nodes, queues


def flat(nominal: int = 8) -> QueuesConfig:
    """Two queues without a cohort: neither lends to the other."""
    return parse_queues({
        "priority_classes": [{"name": "normal", "value": 100, "preemptible": True},
                             {"name": "low", "value": 0, "preemptible": True}],
        "queues": [{"name": q, "quotas": {MODEL: {"nominal": nominal}}} for q in ("team-a", "team-b")],
        "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300}})


def job(job_id: str, queue: str = "team-a", pods: int = 1, min_pods: int | None = None, klass: str = "low"
        ) -> JobSpec:
    return JobSpec(job_id=job_id, team=queue, queue=queue, priority_class=klass,
                   pod_sets=(PodSet(name="worker", count=pods, min_count=min_pods, gpus_per_pod=1,
                                    gpu_models=(MODEL,), cpu_milli=0, memory_mib=0),),
                   max_runtime_s=36_000)


class Loop:
    def __init__(self, config: QueuesConfig, node_count: int = 1, gpus: int = 8) -> None:
        self.adm = AdmissionState(config)
        self.cluster = ClusterState.from_nodes(nodes(node_count, gpus))
        self.stage = PreemptionStage(VictimChooser(config), ServiceAsks())
        self.waiting: dict[str, WaitingJob] = {}
        self.believed: dict[str, Believed] = {}
        self.elastic: dict[str, JobSpec] = {}

    def submit(self, s: JobSpec, at: float = 0.0) -> None:
        assert self.adm.submit(Workload(spec=s, submitted_at=at)) is None

    def decide(self, now: float) -> Decision:
        d = decide(self.adm, self.cluster, self.waiting, list(self.believed.values()), now, stage=self.stage,
                   elastic=self.elastic)
        for w in d.admitted:
            self.waiting[w.job_id] = w
        for p in d.placement.result.placed:
            w = self.waiting.pop(p.job_id)
            self.believed[p.job_id] = Believed(job_id=p.job_id, expected_end=now + w.spec.max_runtime_s)
            if w.spec.elastic:
                self.elastic[p.job_id] = w.spec
        return d

    def end(self, job_id: str) -> None:
        self.cluster.release(job_id)
        self.adm.finish(job_id)
        self.believed.pop(job_id)
        self.elastic.pop(job_id, None)
        self.stage.stopped(job_id)

    def pods(self, job_id: str) -> int:
        p = self.cluster.placement_of(job_id)
        return len(p.bindings) if p is not None else 0

    def charged(self, queue: str = "team-a") -> int:
        return self.adm.usage(queue).get(MODEL, 0)


def test_the_spec_validates_its_range_and_sizes() -> None:
    s = job("e", pods=8, min_pods=2)
    assert s.elastic and s.min_pods == 2 and s.gang_size == 2 and s.total_pods == 8
    assert [p.count for p in s.at_pods(5).pod_sets] == [5] and not s.at_pods(5).elastic
    assert not job("f", pods=4).elastic and job("f", pods=4).model_dump_json() == job("f", pods=4).model_dump_json()
    assert "min_count" not in job("f", pods=4).model_dump_json()  # old events stay byte-identical
    with pytest.raises(ValueError, match="exceeds count"):
        job("g", pods=2, min_pods=3)


def test_an_elastic_job_starts_at_what_fits_and_is_charged_for_those_pods() -> None:
    loop = Loop(queues(a_nominal=16))
    loop.submit(job("fixed", pods=5))
    loop.decide(0.0)
    loop.submit(job("e", pods=8, min_pods=2), 1.0)
    d = loop.decide(1.0)
    assert [p.job_id for p in d.placement.result.placed] == ["e"]
    assert loop.pods("e") == 3  # 8 asked, 3 free: it starts with 3 (at least its floor of 2)
    assert loop.charged() == 5 + 3  # quota charges what runs, not the maximum of 8


def test_a_start_is_capped_by_the_quota_its_queue_can_take() -> None:
    loop = Loop(queues(a_nominal=4, b_nominal=4), node_count=2)
    loop.submit(job("b", "team-b", pods=3))
    loop.decide(0.0)
    loop.submit(job("e", pods=8, min_pods=2), 1.0)
    loop.decide(1.0)
    # 13 GPUs free; team-a may take its nominal 4 and the 1 team-b lends: 5
    assert loop.pods("e") == 5 and loop.charged() == 5


def test_a_running_elastic_job_grows_into_gpus_freed_later() -> None:
    loop = Loop(queues(a_nominal=16))
    loop.submit(job("fixed", pods=6))
    loop.decide(0.0)
    loop.submit(job("e", pods=8, min_pods=2), 1.0)
    loop.decide(1.0)
    assert loop.pods("e") == 2
    loop.end("fixed")
    d = loop.decide(2.0)
    assert [(r.job_id, r.pods_before, r.pods, r.reason) for r in d.resizes] == [("e", 2, 8, GROW)]
    assert loop.pods("e") == 8 and loop.charged() == 8


def test_growth_goes_to_the_queue_furthest_below_its_fair_share() -> None:
    loop = Loop(queues(a_nominal=16, b_nominal=16), node_count=2)
    loop.submit(job("a-big", "team-a", pods=6))
    loop.submit(job("filler", "team-b", pods=8))
    loop.decide(0.0)
    loop.submit(job("a-e", "team-a", pods=8, min_pods=1), 1.0)
    loop.submit(job("b-e", "team-b", pods=8, min_pods=1), 1.0)
    loop.decide(1.0)
    assert (loop.pods("a-e"), loop.pods("b-e")) == (1, 1)  # a-e started with 2, gave 1 back so b-e could start
    loop.end("filler")
    loop.decide(2.0)
    # 8 GPUs freed, one pod at a time to the queue with the fewer GPUs over its nominal 16: team-b (1) until it
    # draws level with team-a (7), then in turn; id order alone would have given a-e all 7 it could take
    assert (loop.pods("a-e"), loop.pods("b-e")) == (2, 8)


def test_an_elastic_job_shrinks_to_make_room_before_anyone_is_preempted() -> None:
    loop = Loop(flat(), node_count=1)
    loop.submit(job("e", "team-a", pods=8, min_pods=2))
    loop.decide(0.0)
    assert loop.pods("e") == 8
    loop.submit(job("boss", "team-b", pods=4, klass="normal"), 5000.0)
    d = loop.decide(5000.0)
    assert "boss" in {p.job_id for p in d.placement.result.placed}
    assert d.preemptions == []  # nobody is preempted: e gave pods back (down to its floor, then grew back to 4)
    assert [(r.job_id, r.pods_before, r.pods, r.reason, r.for_job) for r in d.resizes] == [
        ("e", 8, 4, SHRINK, "boss")]
    assert loop.charged() == 4 and loop.charged("team-b") == 4


def test_pods_above_the_floor_are_given_back_when_the_cohort_waits_and_no_reclaim_preempts() -> None:
    loop = Loop(queues(a_nominal=4, b_nominal=4, window=0), node_count=1)
    loop.submit(job("e", "team-a", pods=8, min_pods=2))
    loop.decide(0.0)
    assert loop.pods("e") == 8 and loop.charged() == 8  # it grew into what team-b lends
    loop.submit(job("b", "team-b", pods=4, klass="normal"), 10.0)
    d = loop.decide(10.0)
    # team-b's job needs its own quota back: e gives back the pods above team-a's nominal 4 (it keeps its own
    # quota), and the reclaim admission asked for waits for the next pass instead of preempting e
    assert d.preemptions == [] and d.admitted == []
    assert [(r.job_id, r.pods_before, r.pods, r.reason, r.for_job) for r in d.resizes] == [("e", 8, 4, SHRINK, None)]
    d = loop.decide(10.0)  # the next pass (the simulator runs it in the same instant)
    assert [w.job_id for w in d.admitted] == ["b"] and "b" in {p.job_id for p in d.placement.result.placed}
    assert d.preemptions == [] and loop.pods("e") == 4
    assert (loop.charged(), loop.charged("team-b")) == (4, 4)


def test_shrinking_for_another_queue_keeps_the_floor_and_nothing_grows_while_a_job_waits() -> None:
    loop = Loop(flat(), node_count=1)
    loop.submit(job("e", "team-a", pods=8, min_pods=6))
    loop.decide(0.0)
    loop.submit(job("b", "team-b", pods=4, klass="low"), 10.0)
    d = loop.decide(10.0)
    # e can give back only 2 pods (its floor is 6): b does not fit, nothing is shrunk, e keeps its 8
    assert loop.pods("e") == 8 and "b" in d.waiting_reasons and d.resizes == []
    loop.submit(job("c", "team-b", pods=2, klass="low"), 20.0)
    d = loop.decide(20.0)
    assert "c" in {p.job_id for p in d.placement.result.placed}
    assert [(r.job_id, r.pods, r.for_job) for r in d.resizes] == [("e", 6, "c")]
    assert loop.charged("team-a") == 6


def test_a_job_of_its_own_queue_waiting_for_admission_takes_every_pod_above_the_floor_back() -> None:
    loop = Loop(flat(), node_count=1)
    loop.submit(job("e", "team-a", pods=8, min_pods=2))
    loop.decide(0.0)
    assert loop.pods("e") == 8 and loop.charged() == 8  # all of team-a's quota
    loop.submit(job("j", "team-a", pods=4), 10.0)
    d = loop.decide(10.0)
    assert [(r.job_id, r.pods, r.reason) for r in d.resizes] == [("e", 2, SHRINK)] and d.admitted == []
    d = loop.decide(10.0)
    assert [w.job_id for w in d.admitted] == ["j"] and "j" in {p.job_id for p in d.placement.result.placed}
    assert loop.pods("e") == 4 and loop.charged() == 8  # grown back into the 2 GPUs of quota left


def test_the_pods_above_the_floor_take_their_cpu_quota_too() -> None:
    config = parse_queues({
        "priority_classes": [{"name": "low", "value": 0, "preemptible": True}],
        "queues": [{"name": "team-a", "quotas": {MODEL: {"nominal": 8}, "cpu_milli": {"nominal": 4000}}}]})
    loop = Loop(config, node_count=1)
    e = JobSpec(job_id="e", team="team-a", queue="team-a", priority_class="low", max_runtime_s=36_000,
                pod_sets=(PodSet(name="worker", count=8, min_count=2, gpus_per_pod=1, gpu_models=(MODEL,),
                                 cpu_milli=1000, memory_mib=0),))
    loop.submit(e)
    loop.decide(0.0)
    # 8 GPUs free and 8 of GPU quota, but 4 CPUs of quota: admitted for its floor (2 pods, 2 CPUs), it starts with
    # the 4 pods its CPU quota holds, and is charged their CPU
    assert loop.pods("e") == 4
    assert loop.adm.usage("team-a") == {MODEL: 4, "cpu_milli": 4000}


def test_fair_share_counts_whole_gpus_only_when_the_queue_also_has_cpu_quota() -> None:
    # growth's order reads the queue's standing in whole GPUs: a cpu_milli or pods quota (and its charge) is not a GPU
    from services.core.admission import AdmissionState, admission_cycle
    from services.core.pipeline.elastic import share
    from tests.unit.admission.admission_core_builders import H100, config, queue, submit
    from tests.unit.admission.admission_core_builders import job as admission_job

    s = AdmissionState(config(queue("team-a", {H100: 8, "cpu_milli": 16_000, "pods": 10})))
    submit(s, admission_job("a", "team-a", 2))
    assert [a.job_id for a in admission_cycle(s, 1.0).admitted] == ["a"]
    assert share(s, "team-a") == 2 / 8
