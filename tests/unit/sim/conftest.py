"""Builders for the simulator's tests: tiny hand-made traces and clusters whose right answers are known."""

from __future__ import annotations

from shared.config import ClusterConfig, NodeGroup
from sim.loaders import queues_for_teams
from sim.model import Trace, TraceJob


def nodes(count: int, gpus: int = 8, model: str = "gpu", nodes_per_rack: int = 4):
    return ClusterConfig(node_groups=(NodeGroup(name="n", count=count, gpus_per_node=gpus, gpu_model=model,
                                                cpu_milli=96_000, memory_mib=1_048_576,
                                                nodes_per_rack=nodes_per_rack),)).nodes()


def job(job_id: str, submit: int, duration: int, pods: int = 1, gpus_per_pod: int = 1, team: str = "a",
        estimate: int | None = None, priority: str = "normal") -> TraceJob:
    return TraceJob(job_id=job_id, submit_time=submit, duration=duration, team=team, queue=team, pods=pods,
                    gpus_per_pod=gpus_per_pod, gpu_models=("gpu",), priority_class=priority,
                    max_runtime_s=estimate if estimate is not None else duration)


def trace(jobs: list[TraceJob], node_count: int = 1, gpus: int = 8, teams: list[str] | None = None) -> Trace:
    ns = nodes(node_count, gpus)
    jobs = sorted(jobs, key=lambda j: (j.submit_time, j.job_id))
    teams = teams or sorted({j.team for j in jobs})
    return Trace(name="tiny", jobs=jobs, nodes=ns, queues=queues_for_teams(teams, {"gpu": node_count * gpus}))
