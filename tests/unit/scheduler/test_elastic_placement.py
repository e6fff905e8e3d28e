"""The placer with an elastic job (PodSet.min_count): the most pods that fit, never fewer than its floor; and the
resize helpers (services/core/scheduler/elastic.py) keep the pods a job has."""

from __future__ import annotations

from services.core.scheduler import ClusterState, Placement, Unplaceable, grow_one, pods_by_set, shrink_to
from shared.domain import JobSpec, PodSet
from tests.unit.preemption.builders import MODEL, nodes


def job(job_id: str, pods: int, min_pods: int | None = None, gpus: int = 1) -> JobSpec:
    return JobSpec(job_id=job_id, team="t", queue="t",
                   pod_sets=(PodSet(name="worker", count=pods, min_count=min_pods, gpus_per_pod=gpus,
                                    gpu_models=(MODEL,), cpu_milli=0, memory_mib=0),))


def placed(cluster: ClusterState, spec: JobSpec) -> Placement:
    got = cluster.place(spec)
    assert isinstance(got, Placement), got
    cluster.commit(got)
    return got


def test_an_elastic_gang_that_does_not_fit_whole_takes_the_most_pods_that_fit() -> None:
    cluster = ClusterState.from_nodes(nodes(2, 8))
    placed(cluster, job("big", 11))
    got = cluster.place(job("e", 8, min_pods=2))
    assert isinstance(got, Placement) and len(got.bindings) == 5  # 5 GPUs free: 5 of its 8 pods
    refused = cluster.place(job("f", 8, min_pods=6))
    assert isinstance(refused, Unplaceable)  # its floor of 6 does not fit: it waits


def test_growing_adds_the_next_pod_and_shrinking_drops_the_highest_keeping_the_floor() -> None:
    cluster = ClusterState.from_nodes(nodes(1, 8))
    spec = job("e", 8, min_pods=2)
    p = placed(cluster, spec.at_pods(3))
    grown = grow_one(cluster, spec, (MODEL,), p)
    assert grown is not None and sorted(b.pod for b in grown.bindings) == ["worker-0", "worker-1", "worker-2",
                                                                            "worker-3"]
    shrunk = shrink_to(cluster, spec, grown, 1)  # never below its floor of 2
    assert sorted(b.pod for b in shrunk.bindings) == ["worker-0", "worker-1"]
    assert pods_by_set(cluster.placement_of("e") or shrunk) == {"worker": 2}
    assert len(placed(cluster, job("other", 6)).bindings) == 6  # the GPUs given back are free
