"""The engine and the metrics on tiny traces whose right answers are known by hand."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine import Engine
from sim.metrics import WALL_CLOCK_FIELDS, compute_metrics, isolated_finish_times, jain
from sim.policies.baselines import PodFifo, QuotaFifo
from sim.policies.gpuq import GpuqPolicy
from sim.run import make_policy, run_policies

from .conftest import job, trace

ALL = ("gpuq", "kueue", "slurm", "volcano", "quota-fifo", "pod-fifo")


def _run(tr, policy):
    res = Engine(tr, policy).run()
    return res, compute_metrics(res, sim_wall_s=1.0)


@pytest.mark.parametrize("name", ALL)
def test_two_full_node_jobs_run_back_to_back(name):
    # One 8-GPU node; A (8 GPUs, 100 s) at t=0, B (8 GPUs, 50 s) at t=10: B waits 90 s and ends at 150.
    tr = trace([job("a", 0, 100, gpus_per_pod=8), job("b", 10, 50, gpus_per_pod=8)])
    res, m = _run(tr, make_policy(name))
    assert res.records["b"].start == 100 and res.records["b"].end == 150
    assert m["completed"] == 2
    assert m["avg_jct_s"] == pytest.approx((100 + 140) / 2)
    assert m["p50_wait_s"] == pytest.approx(45.0)
    assert m["makespan_s"] == 150
    assert m["gpu_utilization"] == pytest.approx(1.0)  # the node is full over the submission window [0, 10]
    assert m["gpu_utilization_to_makespan"] == pytest.approx(1.0)
    assert m["delivered_gpu_hours"] == pytest.approx(8 * 150 / 3600, abs=1e-3)
    assert m["idle_partial_gang_gpu_hours"] == 0.0
    assert m["preemptions"] == 0 and m["lost_gpu_hours"] == 0.0
    assert m["per_team"]["a"]["jobs"] == 2 and m["per_team"]["a"]["usage_share"] == 1.0


def _partial_gang_trace():
    # Two 8-GPU nodes. X1 takes 6 GPUs of node 0 until 100, X2 4 GPUs of node 1 until 200 (first fit).
    # Y (2 pods × 3 GPUs) arrives at t=1: quota has room (6 free GPUs) but only node 1 can take a pod.
    # Pod by pod, Y's first pod lands on node 1 and holds 3 GPUs idle until X1 ends at 100.
    return trace([job("x1", 0, 100, gpus_per_pod=6), job("x2", 0, 200, gpus_per_pod=4),
                  job("y", 1, 10, pods=2, gpus_per_pod=3)], node_count=2)


@pytest.mark.parametrize("name", ["pod-fifo", "quota-fifo"])
def test_partial_gang_holds_gpus_idle_in_baselines(name):
    res, m = _run(_partial_gang_trace(), make_policy(name))
    assert res.records["y"].start == 100
    assert m["idle_partial_gang_gpu_hours"] == pytest.approx(3 * 99 / 3600, abs=1e-3)
    # Over [0, 200]: allocated 6×100 + 4×200 + 3×99 (idle half of Y) + 6×10 GPU-seconds on 16 GPUs.
    assert m["gpu_utilization_to_makespan"] == pytest.approx((600 + 800 + 297 + 60) / (16 * 200), abs=1e-3)


def test_gpuq_never_holds_a_partial_gang():
    res, m = _run(_partial_gang_trace(), GpuqPolicy())
    assert res.records["y"].start == 100
    assert m["idle_partial_gang_gpu_hours"] == 0.0
    assert m["gpu_utilization"] == m["busy_gpu_utilization"]


def test_gpuq_backfills_a_short_job_around_the_head_reservation():
    # 8 GPUs. A holds 4 until 100 (estimate 100). Head H needs 8; S needs 4 for 50 s (estimate 50) and ends
    # before H's reservation at 100, so it starts now. FIFO baselines keep S behind H.
    jobs = [job("a", 0, 100, gpus_per_pod=4), job("h", 1, 100, gpus_per_pod=8), job("s", 2, 50, gpus_per_pod=4)]
    res, _ = _run(trace(jobs), GpuqPolicy())
    assert res.records["s"].start == 2
    assert res.records["h"].start == 100
    res_fifo, _ = _run(trace(jobs), QuotaFifo())
    assert res_fifo.records["h"].start == 100


def test_wait_of_a_job_that_never_starts_counts_until_the_end():
    # pod-fifo deadlock: two 2×8 gangs interleave on two nodes only if pods arrive interleaved; instead
    # check the censoring rule directly with a job no node can hold (rejected, not waiting).
    tr = trace([job("a", 0, 10, gpus_per_pod=8), job("big", 0, 10, gpus_per_pod=16)])
    res, m = _run(tr, PodFifo())
    assert res.records["big"].rejected == "Unschedulable"
    assert m["rejected"] == 1 and m["completed"] == 1


def test_jain_index():
    assert jain([1.0, 1.0, 1.0]) == 1.0
    assert jain([1.0, 0.0]) == 0.5
    assert jain([]) == 1.0


def test_isolated_share_finish_times():
    # Two teams, 8 GPUs: each has an isolated share of 4 GPUs. a1 (4 GPUs, 100 s) then a2 (4 GPUs, 100 s)
    # queue behind each other in isolation: a2 finishes 200 s after t=0, i.e. 190 s after its submit at 10.
    # b1 needs 8 > 4: it runs on the whole share, twice as long.
    tr = trace([job("a1", 0, 100, gpus_per_pod=4), job("a2", 10, 100, gpus_per_pod=4),
                job("b1", 0, 50, gpus_per_pod=8, team="b")])
    iso = isolated_finish_times(tr)
    assert iso == {"a1": 100.0, "a2": 190.0, "b1": 100.0}


def _deterministic_trace():
    jobs = []
    for i in range(60):
        jobs.append(job(f"j{i:03d}", submit=(i * 37) % 400, duration=50 + (i * 53) % 300,
                        pods=1 + (i % 7 == 0), gpus_per_pod=(1, 2, 4, 8)[i % 4], team=("a", "b", "c")[i % 3],
                        estimate=600, priority=("normal", "low", "high")[i % 3]))
    return trace(jobs, node_count=3)


def test_replay_is_deterministic():
    def once() -> str:
        runs = run_policies(_deterministic_trace(), ALL)
        docs = [{k: v for k, v in r.metrics.items() if k not in WALL_CLOCK_FIELDS} for r in runs]
        return json.dumps(docs, sort_keys=True)

    first, second = once(), once()
    assert first == second
    assert '"completed": 60' in first


@st.composite
def small_traces(draw):
    n = draw(st.integers(1, 12))
    jobs = []
    for i in range(n):
        pods = draw(st.sampled_from([1, 1, 1, 2]))
        per_pod = draw(st.sampled_from([1, 2, 4, 8])) if pods == 1 else 8
        jobs.append(job(f"j{i}", submit=draw(st.integers(0, 50)), duration=draw(st.integers(1, 40)), pods=pods,
                        gpus_per_pod=per_pod, team=draw(st.sampled_from(["a", "b"])),
                        estimate=draw(st.integers(1, 80))))
    return trace(jobs, node_count=2, teams=["a", "b"])


@settings(max_examples=60, deadline=None)
@given(tr=small_traces(), name=st.sampled_from(ALL))
def test_every_job_runs_once_for_its_true_duration_within_capacity(tr, name):
    res, m = _run(tr, make_policy(name))
    cap = tr.capacity_gpus * 1000
    assert all(s.busy_milli <= s.allocated_milli <= cap for s in res.samples)
    for j in tr.jobs:
        r = res.records[j.job_id]
        assert r.start is not None and r.start >= j.submit_time
        if r.preemptions == 0:
            assert r.end == r.start + j.duration  # one uninterrupted run
        else:  # only kueue preempts here (it evicts, without checkpoints): the lost work is run again
            assert name == "kueue" and r.end is not None and r.end >= r.start + j.duration
    assert m["completed"] == len(tr.jobs)
    if name == "gpuq":
        assert m["idle_partial_gang_gpu_hours"] == 0.0
