"""The peer baselines (`kueue`, `slurm`, `volcano`) on tiny traces whose right answers follow from each peer's
documented semantics (sim/policies/kueue.py, slurm.py, volcano.py say where each rule comes from)."""

from __future__ import annotations

import math

import pytest

from sim.engine import Engine
from sim.metrics import compute_metrics
from sim.policies.slurm import DecayedUsage
from sim.policies.volcano import water_fill
from sim.run import make_policy

from .conftest import job, trace


def _run(tr, name):
    res = Engine(tr, make_policy(name)).run()
    return res, compute_metrics(res, sim_wall_s=1.0)


def test_kueue_preempts_a_lower_priority_job_of_its_own_queue_and_quota_fifo_does_not():
    # One queue, 8 GPUs of quota, one 8-GPU node. `low` takes everything at t=0; `high` arrives at t=10.
    tr = trace([job("low", 0, 1000, gpus_per_pod=8, priority="low"),
                job("high", 10, 100, gpus_per_pod=8, priority="high")])
    res, m = _run(tr, "kueue")
    assert res.records["high"].start == 10  # withinClusterQueue: LowerPriority evicts `low` at once
    assert res.records["low"].preemptions == 1
    # evicted without checkpoint: its 10 s of work are lost and it runs its full 1000 s again after `high`
    assert res.records["low"].end == 110 + 1000
    assert m["lost_gpu_hours"] == pytest.approx(8 * 10 / 3600, abs=1e-3)
    res, _ = _run(tr, "quota-fifo")
    assert res.records["high"].start == 1000 and res.records["low"].preemptions == 0


def test_kueue_reclaims_borrowed_quota_of_any_priority():
    # Teams a and b share one 8-GPU node, 4 GPUs of quota each, in one cohort. a borrows b's half with eight
    # 1-GPU high-priority jobs; b's low-priority 2-GPU job at t=10 fits its nominal quota: reclaimWithinCohort Any
    # evicts two of a's borrowing jobs although they have the higher priority.
    jobs = [job(f"a{i}", 0, 1000, team="a", priority="high") for i in range(8)]
    jobs.append(job("b", 10, 50, gpus_per_pod=2, team="b", priority="low"))
    res, _ = _run(trace(jobs), "kueue")
    assert res.records["b"].start == 10
    assert sum(res.records[f"a{i}"].preemptions for i in range(8)) == 2
    res, _ = _run(trace(jobs), "quota-fifo")
    assert res.records["b"].start == 1000  # no reclaim: b waits for a's borrowers to end


def test_kueue_best_effort_fifo_lets_a_later_job_past_a_head_that_does_not_fit():
    # Teams a and b, 4 GPUs of quota each on one 8-GPU node; b is idle, so a may use all 8 by borrowing.
    jobs = [job("x", 0, 100, gpus_per_pod=6, team="a"),
            job("y", 1, 10, gpus_per_pod=4, team="a"),  # 6 + 4 > 8 (a's nominal 4 + b's lendable 4)
            job("z", 2, 10, gpus_per_pod=2, team="a")]  # 6 + 2 fits: BestEffortFIFO admits it past y
    res, _ = _run(trace(jobs, teams=["a", "b"]), "kueue")
    assert res.records["z"].start == 2 and res.records["y"].start == 100
    res, _ = _run(trace(jobs, teams=["a", "b"]), "quota-fifo")
    assert res.records["z"].start == 100  # StrictFIFO: y blocks its queue


def test_slurm_easy_backfill_uses_the_estimates_and_protects_the_reservation():
    # One 8-GPU node. r runs 6 GPUs until its estimate 100. head (8 GPUs) is blocked: reserved at t=100.
    # short (2 GPUs, estimate 50) ends before the reservation: it backfills at once.
    # long (2 GPUs, estimate 500, arriving after short ended) would run past t=100 on the reserved node: it waits.
    tr = trace([job("r", 0, 100, gpus_per_pod=6),
                job("head", 1, 10, gpus_per_pod=8),
                job("short", 2, 50, gpus_per_pod=2),
                job("long", 60, 500, gpus_per_pod=2)])
    res, _ = _run(tr, "slurm")
    assert res.records["short"].start == 2
    assert res.records["head"].start == 100
    assert res.records["long"].start == 110


def test_volcano_gangs_are_all_or_nothing_and_nothing_is_reserved():
    # Two 8-GPU nodes. x1 holds 6 GPUs of node 0 and x2 4 of node 1 until 100 and 200. The gang y (2 pods × 3
    # GPUs) fits only one pod now: nothing of it is held (no idle partial gang), and the later 2-GPU job z
    # starts at once past it (no reservation), where pod-fifo parks one of y's pods on node 1 first.
    tr = trace([job("x1", 0, 100, gpus_per_pod=6), job("x2", 0, 200, gpus_per_pod=4),
                job("y", 1, 10, pods=2, gpus_per_pod=3), job("z", 2, 10, gpus_per_pod=2)], node_count=2)
    res, m = _run(tr, "volcano")
    assert m["idle_partial_gang_gpu_hours"] == 0.0
    assert res.records["z"].start == 2
    assert res.records["y"].start == 100


def test_volcano_deserved_shares_are_water_filled_by_weight():
    # 12 GPUs, weights 1:1:2. c asks only 2: it gets them, and a and b split the other 10 by weight.
    got = water_fill(12.0, {"a": 1.0, "b": 1.0, "c": 2.0}, {"a": 20.0, "b": 20.0, "c": 2.0})
    assert got == pytest.approx({"a": 5.0, "b": 5.0, "c": 2.0})
    assert water_fill(12.0, {"a": 1.0}, {"a": 0.0}) == {"a": 0.0}


def test_slurm_usage_decays_with_its_half_life():
    u = DecayedUsage(half_life_s=100.0)
    u.hold("a", 1.0, 0.0)
    u.hold("a", -1.0, 100.0)  # one GPU for 100 s: ∫ 2^(-(100-s)/100) ds = 100 / ln 2 × (1 - 1/2)
    assert u.usage["a"] == pytest.approx(50 / math.log(2))
    u.advance(200.0)
    assert u.usage["a"] == pytest.approx(25 / math.log(2))  # one half-life later: half of it


def _predictions(durations: dict[str, int]) -> dict[str, float]:
    # Five finished jobs of team a (limit 1000 s), then x arrives at t=5000 with the same limit.
    jobs = [job(f"h{i}", i * 10, durations.get(f"h{i}", 100), estimate=1000) for i in range(5)]
    jobs.append(job("x", 5000, durations.get("x", 100), estimate=1000))
    policy = make_policy("gpuq-duration")
    Engine(trace(jobs), policy).run()
    return dict(policy.predicted)  # type: ignore[attr-defined]  # GpuqPolicy: predictions given to admission


def test_duration_aware_prediction_never_reads_the_true_duration():
    base = _predictions({})
    assert base["h0"] == 1000.0  # no history yet: the limit is all that is known
    assert base["x"] == pytest.approx(100.0)  # five similar jobs ran 100 s of their 1000 s limit
    assert _predictions({"x": 900})["x"] == base["x"]  # x's own true duration changes nothing
    assert _predictions({f"h{i}": 500 for i in range(5)})["x"] == pytest.approx(500.0)  # history does


def test_gpuq_fairtime_serves_the_team_that_did_not_borrow_first():
    # Teams a and b, 4 GPUs of quota each, one 8-GPU node. a borrowed the whole node for two weeks (two
    # half-lives: its decayed average is 8 × 3/4 = 6 GPUs, 2 above its quota). Then both submit an 8-GPU job
    # (each must borrow 4): plain gpuq breaks the tie by id (a), gpuq-fairtime counts a's past borrowing (usage
    # decayed with a 7-day half-life) and serves b first.
    t = 14 * 86_400
    jobs = [job("a1", 0, t, gpus_per_pod=8, team="a"),
            job("a2", t + 1, 100, gpus_per_pod=8, team="a"), job("b2", t + 1, 100, gpus_per_pod=8, team="b")]
    plain, _ = _run(trace(jobs), "gpuq")
    fair, _ = _run(trace(jobs), "gpuq-fairtime")
    assert plain.records["a2"].start == t + 1 and plain.records["b2"].start == t + 101
    assert fair.records["b2"].start == t + 1 and fair.records["a2"].start == t + 101


def test_plain_gpuq_follows_the_queues_policy_as_the_services_do():
    # The production options (policy.usage_half_life_s, policy.duration_ordering) turn the same inputs on in
    # `gpuq`: a what-if of a production queues.yaml replays what the services would decide.
    t = 14 * 86_400
    jobs = [job("a1", 0, t, gpus_per_pod=8, team="a"),
            job("a2", t + 1, 100, gpus_per_pod=8, team="a"), job("b2", t + 1, 100, gpus_per_pod=8, team="b")]
    tr = trace(jobs)
    tr.queues = tr.queues.model_copy(update={"policy": tr.queues.policy.model_copy(
        update={"usage_half_life_s": 7 * 86_400, "duration_ordering": True})})
    configured, _ = _run(tr, "gpuq")
    assert configured.records["b2"].start == t + 1 and configured.records["a2"].start == t + 101
    policy = make_policy("gpuq")
    Engine(tr, policy).run()
    assert policy.predicted  # type: ignore[attr-defined]  # GpuqPolicy: predictions given to admission


def test_gpuq_sends_a_reclaim_once_as_the_admission_service_does():
    # Teams a and b, 4 GPUs of quota each, one 8-GPU node. a's 8 jobs borrow b's half from t=0; b's job at
    # t=10 asks to reclaim while a's jobs are inside their protection window (600 s), so no victim is found.
    # Later arrivals make more passes: the decision loop's victim chooser still hears b's reclaim once (the
    # service sends it once; this chooser reports no `next_wake`, so nothing is asked again when the protection
    # ends).
    from services.core.pipeline import VictimChooser
    from sim.policies.gpuq import GpuqPolicy

    seen: list[str] = []

    class Hearing(VictimChooser):
        def __call__(self, ctx):
            seen.extend(r.preemptor for r in ctx.reclaims)
            self.next_wake = None
            return []

    jobs = [job(f"a{i}", 0, 5000, team="a", priority="low") for i in range(8)]
    jobs += [job("b", 10, 50, team="b")] + [job(f"late{i}", 20 + i, 10, team="a") for i in range(5)]
    Engine(trace(jobs), GpuqPolicy(preemption=Hearing)).run()
    # (a's later normal jobs may ask admission for preemption within their own queue: once each too)
    assert seen.count("b") == 1 and len(seen) == len(set(seen))
