"""The ETA refresh's fast paths give the ETAs of the unoptimised code to the last bit (issue 49 item 5, 'ETAs that
scale'): the cohort mixture's quantile search (its normal CDF inlined, its midpoints evaluated once for the
median, p10 and p90 searches) against a copy of the code before, and a refresh running the median replay alone
(`range_method="calibrated"`) that predicts the running jobs' medians only."""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.admission import AdmissionState, Workload, admission_cycle
from services.core.eta import EtaModel, RunningView, estimate_ranges
from services.core.pipeline.predict import BISECT_TOLERANCE_S, COHORT_MIN_BANDWIDTH, cohort_quantile_fn
from services.core.scheduler import ClusterState, PendingJob, schedule_cycle
from sim.loaders import queues_for_teams

from .conftest import job, nodes


def _reference_phi(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def _reference_cohort_quantile_fn(near: Sequence[tuple[float, float]], prior: Sequence[float],
                                  prior_weight: float, elapsed_s: float,
                                  censored: Sequence[tuple[float, float]] = ()) -> Callable[[float], float] | None:
    """`cohort_quantile_fn` as it was before its fast path (83c37ee), kept verbatim to compare against."""
    total_w = sum(w for w, _ in near)
    if total_w <= 0 and not prior:
        return None
    mean = sum(w * mu for w, mu in near) / total_w if total_w > 0 else 0.0
    var = sum(w * (mu - mean) ** 2 for w, mu in near) / total_w if total_w > 0 else 0.0
    n_eff = total_w ** 2 / sum(w * w for w, _ in near) if total_w > 0 else 0.0
    if n_eff < 2.0:
        logs = [math.log(max(v, 1.0)) for v in prior]
        pm = sum(logs) / len(logs)
        var = sum((x - pm) ** 2 for x in logs) / len(logs)
        n_eff = max(n_eff, 1.0)
    bw = max(COHORT_MIN_BANDWIDTH, 1.06 * math.sqrt(var) * n_eff ** -0.2)
    le = math.log(max(elapsed_s, 1.0))
    n_prior = len(prior)
    if censored:
        weights = [w for w, _ in near]
        extra_prior = 0.0
        for v, c in censored:
            lasting = [w * (1.0 - _reference_phi((c - mu) / bw)) for w, mu in near]
            prior_lasting = prior_weight * (n_prior - bisect.bisect_right(prior, math.exp(c))) / n_prior
            zc = sum(lasting) + prior_lasting
            if zc <= 1e-12:
                continue
            for i, m in enumerate(lasting):
                weights[i] += v * m / zc
            extra_prior += v * prior_lasting / zc
        near = [(w, mu) for w, (_, mu) in zip(weights, near, strict=True)]
        prior_weight += extra_prior
    near = [(w, mu) for w, mu in near if (le - mu) / bw < 8.0]
    first_alive = bisect.bisect_right(prior, elapsed_s)
    prior_alive = prior_weight * (n_prior - first_alive) / n_prior
    at_elapsed = [(w, mu, _reference_phi((le - mu) / bw)) for w, mu in near]

    def mass_above_elapsed_below(lx: float) -> float:
        x = math.exp(lx)
        m = sum(w * (_reference_phi((lx - mu) / bw) - c) for w, mu, c in at_elapsed)
        return m + prior_weight * max(0, bisect.bisect_right(prior, x) - first_alive) / n_prior

    z = sum(w * (1.0 - c) for w, _, c in at_elapsed) + prior_alive
    if z <= 1e-12:
        return None
    hi0 = max([le + 1e-6] + [mu + 8.0 * bw for _, mu in near] + [math.log(max(prior[-1], 1.0)) + 1e-6])

    def total(q: float) -> float:
        lo, hi = le, hi0
        for _ in range(36):
            if math.exp(hi) - math.exp(lo) < BISECT_TOLERANCE_S:
                break
            mid = 0.5 * (lo + hi)
            if mass_above_elapsed_below(mid) < q * z:
                lo = mid
            else:
                hi = mid
        return math.exp(hi)

    return total


_log_s = st.floats(math.log(30.0), math.log(30 * 86_400.0))


@settings(max_examples=300, deadline=None)
@given(near=st.lists(st.tuples(st.floats(0.01, 3.0), _log_s), max_size=32),
       prior=st.lists(st.floats(30.0, 30 * 86_400.0), min_size=1, max_size=60),
       prior_weight=st.floats(1.0, 50.0), elapsed=st.floats(0.0, 10 * 86_400.0),
       censored=st.lists(st.tuples(st.floats(0.01, 3.0), _log_s), max_size=32))
def test_the_cohort_quantiles_equal_the_code_before_to_the_last_bit(near, prior, prior_weight, elapsed, censored):
    prior = sorted(prior)
    fast = cohort_quantile_fn(near, prior, prior_weight, elapsed, censored)
    slow = _reference_cohort_quantile_fn(near, prior, prior_weight, elapsed, censored)
    assert (fast is None) == (slow is None)
    if fast is None or slow is None:
        return
    # (in the order a refresh asks: median, p10, p90, then others, so that shared midpoints are answered from memory)
    for q in (0.5, 0.1, 0.9, 0.5, 0.25, 0.75, 0.999):
        assert fast(q) == slow(q)


def _sweep_model() -> tuple[EtaModel, dict[str, RunningView], float]:
    """A model with a team's window, part of a sweep ended (cohort evidence) and the rest running (peers), one of
    them with checkpoint progress, and another team's job without a cohort."""
    rng = random.Random(7)
    model = EtaModel(range_method="calibrated")
    for i in range(60):
        d = rng.uniform(600, 18_000)
        model.job_finished(job(f"old-{i}", 0, 10, estimate=int(d * rng.uniform(1.2, 4)) + 1).spec(), d,
                           ended_at=-1e6 + i)
    sweep = [RunningView(job(f"s-{i}", 0, 10, estimate=[3600, 7200, 14_400][i % 3]).spec(), started_at=float(i))
             for i in range(40)]
    for v in sweep[:15]:
        model.job_finished(v.spec, rng.uniform(500, 2000), ended_at=v.started_at + 2000.0)
    running = {v.spec.job_id: v for v in sweep[15:]}
    running["s-39"] = RunningView(sweep[39].spec, started_at=39.0, progress=0.4)
    running["b-1"] = RunningView(job("b-1", 0, 10, estimate=7200, team="b").spec(), started_at=100.0)
    return model, running, 2500.0


def test_a_median_only_refresh_predicts_the_same_medians():
    model, running, now = _sweep_model()
    full = model.all_expected_ends(running, now)
    median = model.all_expected_ends(running, now, median_only=True)
    assert median == {j: (e[1],) * 3 for j, e in full.items()}
    assert len({e[0] for e in full.values()} - {e[1] for e in full.values()}) > 0  # (the p10s differ: a real test)


def test_a_calibrated_refresh_gives_the_etas_it_gave_with_every_quantile_predicted(monkeypatch):
    model, running, now = _sweep_model()
    cluster = ClusterState.from_nodes(nodes(4))
    adm = AdmissionState(queues_for_teams(["a", "b"], {"gpu": 32}))
    for v in running.values():
        assert adm.submit(Workload(spec=v.spec, submitted_at=0.0)) is None
    decision = admission_cycle(adm, 0.0, capacity=cluster.free_gpus_by_model())
    placed = schedule_cycle(cluster, [PendingJob(spec=a.spec) for a in decision.admitted], [], 0.0)
    assert len(placed.placed) == len(running)
    for i in range(6):
        assert adm.submit(Workload(spec=job(f"w-{i}", 2400, 10, gpus_per_pod=4, estimate=3600).spec(),
                                   submitted_at=now)) is None
    views = running
    fast = estimate_ranges(cluster, adm, views, now, model)
    every = EtaModel.all_expected_ends

    def unoptimised(self, running, now, median_only=False):  # (the old path: every quantile)
        return every(self, running, now)

    monkeypatch.setattr(EtaModel, "all_expected_ends", unoptimised)
    slow = estimate_ranges(cluster, adm, views, now, model)
    assert fast and fast == slow


@pytest.mark.parametrize("method", ["replays", "calibrated"])
def test_median_replay_only_is_what_the_refresh_runs(method):
    assert EtaModel(range_method=method).median_replay_only is (method == "calibrated")
    assert EtaModel(predict=False, range_method=method).median_replay_only


def test_alike_running_jobs_are_predicted_once_each_as_on_its_own():
    """Jobs alike in group key, limit, start and progress (a sweep started in one cycle) share one prediction; one
    that differs in progress alone does not."""
    model, running, now = _sweep_model()
    limit = running["s-20"].spec.max_runtime_s
    twins = {f"s-{100 + k}": RunningView(job(f"s-{100 + k}", 0, 10, estimate=limit).spec(), started_at=20.0,
                                         progress=0.5 if k == 0 else None) for k in range(3)}
    every = running | twins
    shared = model.all_expected_ends(every, now)
    # the path without sharing: each job predicted on its own, after the same hand-over of the running jobs
    assert shared == {j: model.expected_ends(v, now) for j, v in sorted(every.items())}
    assert shared["s-101"] == shared["s-102"] == shared["s-20"] != shared["s-100"]
