"""ETAs with predicted durations and a calibrated range, and their accuracy measured in the simulator."""

from __future__ import annotations

import json
import math
import random

import pytest
from typer.testing import CliRunner

from cli.main import app
from services.core.admission import AdmissionState, Workload, admission_cycle
from services.core.eta import (
    IDLE_REFRESH_S,
    EtaCalibration,
    EtaModel,
    RunningView,
    estimate_ranges,
    estimate_starts,
    refresh_due,
)
from services.core.pipeline.predict import JobKey
from services.core.scheduler import ClusterState, PendingJob, schedule_cycle
from sim.engine import Engine
from sim.eta_accuracy import EtaTracked, eta_metrics
from sim.loaders import queues_for_teams
from sim.run import make_policy

from .conftest import job, nodes, trace
from .test_eta_cli import _state_with


def test_replay_uses_predicted_durations_but_the_schedulers_beliefs():
    """Time advances by predictions, the scheduler still reserves by limits: p1 starts when r1 is predicted to
    end, and p2 follows after p1's predicted run, not its limit."""
    running = [job("r1", 0, 10, gpus_per_pod=6, estimate=3600)]
    pending = [job("p1", 5, 10, gpus_per_pod=8, estimate=600), job("p2", 5, 10, gpus_per_pod=8, estimate=600)]
    cluster, adm = _state_with(running, pending, now=5.0)
    etas = estimate_starts(cluster, adm, {"r1": 1000.0}, now=5.0, duration=lambda spec: 200.0,
                           believed_ends={"r1": 3600.0})
    assert etas == {"p1": 1000.0, "p2": 1200.0}


def test_the_replay_preempts_as_the_platform_does_once_the_lower_priority_jobs_protection_ends():
    """A low-priority job holds the queue's 8 GPUs until 3600 s; a normal job waits for them. The platform
    preempts the low job when its protection window (600 s from its start) ends, so with the running jobs'
    starts the replay starts the normal job then, and the low job, preempted, waits again and restarts after the
    normal job's run with the run time it had left. Without the starts nothing is preempted (the old replay)."""
    running = [job("low", 0, 10, gpus_per_pod=8, estimate=7200, priority="low")]
    pending = [job("p1", 5, 10, gpus_per_pod=8, estimate=600)]
    cluster, adm = _state_with(running, pending, now=5.0)
    window = adm.config.policy.protection_window_s
    assert window == 600
    before = (dict(cluster.allocations()), dict(adm.pending), dict(adm.admitted))
    assert estimate_starts(cluster, adm, {"low": 3600.0}, now=5.0) == {"p1": 3600.0}
    etas = estimate_starts(cluster, adm, {"low": 3600.0}, now=5.0, started={"low": 0.0})
    assert etas == {"p1": float(window)}
    assert (dict(cluster.allocations()), dict(adm.pending), dict(adm.admitted)) == before  # pure
    # a job behind the normal one: the low job restarts after p1's 600 s and runs its remaining 3000 s
    pending2 = [job("p1", 5, 10, gpus_per_pod=8, estimate=600), job("p2", 6, 10, gpus_per_pod=8, estimate=600,
                                                                     priority="low")]
    cluster, adm = _state_with(running, pending2, now=6.0)
    etas = estimate_starts(cluster, adm, {"low": 3600.0}, now=6.0, started={"low": 0.0})
    assert etas["p1"] == float(window)
    assert etas["p2"] == pytest.approx(window + 600.0 + 3000.0)  # after p1, then the restarted low job's rest


def test_the_replay_never_preempts_a_job_inside_its_window_or_of_higher_priority():
    """A low job started at 500 s is protected until 1100 s: the normal job's ETA is then, not at 600 s; a
    normal job never preempts another normal one (it waits for its end)."""
    running = [job("low", 0, 10, gpus_per_pod=8, estimate=7200, priority="low")]
    cluster, adm = _state_with(running, [job("p1", 5, 10, gpus_per_pod=8, estimate=600)], now=5.0)
    assert estimate_starts(cluster, adm, {"low": 3600.0}, now=5.0, started={"low": 500.0}) == {"p1": 1100.0}
    running = [job("r1", 0, 10, gpus_per_pod=8, estimate=7200)]
    cluster, adm = _state_with(running, [job("p1", 5, 10, gpus_per_pod=8, estimate=600)], now=5.0)
    assert estimate_starts(cluster, adm, {"r1": 3600.0}, now=5.0, started={"r1": 0.0}) == {"p1": 3600.0}


def _unplaceable_behind_low(now: float):
    """The queue's quota (16) is more than its node holds (8), as when pods gpuq does not manage hold GPUs: p1 is
    admitted but cannot be placed while the low job holds the node, so the scheduler asks for preemption."""
    cluster = ClusterState.from_nodes(nodes(1))
    adm = AdmissionState(queues_for_teams(["a"], {"gpu": 16}))
    assert adm.submit(Workload(spec=job("low", 0, 86_400, gpus_per_pod=8, priority="low").spec(),
                               submitted_at=0.0)) is None
    decision = admission_cycle(adm, 0.0, capacity=cluster.free_gpus_by_model())
    assert len(schedule_cycle(cluster, [PendingJob(spec=a.spec) for a in decision.admitted], [], 0.0).placed) == 1
    assert adm.submit(Workload(spec=job("p1", 0, 3600, gpus_per_pod=8).spec(), submitted_at=now)) is None
    return cluster, adm


def test_the_replay_preempts_for_an_admitted_job_the_scheduler_cannot_place_when_the_window_ends():
    """The scheduler asks for preemption for an admitted job it cannot place (a lower-priority job holds the GPUs);
    the platform takes that job when its protection window ends (600 s from its start), ten minutes away here, not
    at its end a day later: the ETA says so, inside the window and after it (the replay used to leave the
    scheduler's asks out and gave the 24 h)."""
    cluster, adm = _unplaceable_behind_low(now=100.0)
    window = adm.config.policy.protection_window_s
    assert estimate_starts(cluster, adm, {"low": 86_400.0}, now=100.0, started={"low": 0.0}) == {"p1": float(window)}
    assert estimate_starts(cluster, adm, {"low": 86_400.0}, now=100.0) == {"p1": 86_400.0}  # nothing preempted
    from services.eta.platform import PlatformEta

    eta = PlatformEta(EtaModel(expect_arrivals=False))  # admission's ETA, from the end the scheduler reserves by
    assert eta(cluster, adm, {"low": 86_400.0}, 100.0)["p1"].start == float(window)
    cluster, adm = _unplaceable_behind_low(now=1000.0)  # past the window: taken now
    assert estimate_starts(cluster, adm, {"low": 86_400.0}, now=1000.0, started={"low": 0.0}) == {"p1": 1000.0}


def test_a_waiting_job_preempted_recently_gets_the_preemptors_cool_down_in_the_replay():
    """p1 was itself preempted 100 s ago: the preemption service defers its request to the end of the cool-down
    (the protection window, 600 s, after that preemption), so the replay starts it then, not at once as a job
    never preempted, which takes the (unprotected) low job's GPUs now, nor at the low job's end."""
    running = [job("low", 0, 10, gpus_per_pod=8, estimate=7200, priority="low")]
    cluster, adm = _state_with(running, [job("p1", 5, 10, gpus_per_pod=8, estimate=600)], now=1000.0)
    ends = {"low": 3600.0}
    assert estimate_starts(cluster, adm, ends, now=1000.0, started={"low": 0.0}) == {"p1": 1000.0}
    assert estimate_starts(cluster, adm, ends, now=1000.0, started={"low": 0.0},
                           preempted_at={"p1": 900.0}) == {"p1": 1500.0}


def _count_cycles(monkeypatch) -> list[int]:
    """Count the decision passes a replay runs (estimate_starts imports `decide` when called)."""
    import services.core.pipeline as pipeline

    calls = [0]
    real = pipeline.decide

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "decide", counting)
    return calls


def test_ends_close_together_are_replayed_as_one_cycle_at_the_latest(monkeypatch):
    """Eight 1-GPU jobs ending a second apart an hour ahead free the node for an 8-GPU job: with the default
    resolution (2% of the look-ahead) they are one step, and the start is the last end, never earlier."""
    running = [job(f"r{i}", 0, 10, gpus_per_pod=1, estimate=3600) for i in range(8)]
    cluster, adm = _state_with(running, [job("p1", 5, 10, gpus_per_pod=8, estimate=600)], now=5.0)
    ends = {f"r{i}": 3600.0 + i for i in range(8)}
    calls = _count_cycles(monkeypatch)
    assert estimate_starts(cluster, adm, ends, now=5.0) == {"p1": 3607.0}
    coalesced = calls[0]
    calls[0] = 0
    assert estimate_starts(cluster, adm, ends, now=5.0, resolution=0.0) == {"p1": 3607.0}
    assert coalesced == 2 and calls[0] == 9  # now + one step, against now + one per end
    with pytest.raises(ValueError, match="resolution"):
        estimate_starts(cluster, adm, ends, now=5.0, resolution=1.5)


def test_a_start_beyond_the_horizon_gets_no_eta_and_costs_a_bounded_replay(monkeypatch):
    """A job that waits for 8 days of ends (one every 10 minutes) is beyond the 7-day horizon: no ETA (not a
    date), and the replay runs far fewer cycles than there are ends (the resolution grows with the look-ahead)."""
    running = [job(f"r{i}", 0, 10, gpus_per_pod=1, estimate=10 * 86_400) for i in range(8)]
    cluster, adm = _state_with(running, [job("p1", 5, 10, gpus_per_pod=8, estimate=600)], now=5.0)
    ends = {f"r{i}": 8 * 86_400.0 - i * 600 for i in range(8)}
    calls = _count_cycles(monkeypatch)
    assert estimate_starts(cluster, adm, ends, now=5.0) == {}
    assert estimate_starts(cluster, adm, ends, now=5.0, horizon_s=9 * 86_400) == {"p1": 8 * 86_400.0}
    assert calls[0] <= 8


def test_a_model_without_history_gives_the_limit_eta_and_learns_from_ended_jobs():
    running = [job("r1", 0, 10, gpus_per_pod=6, estimate=3600)]
    cluster, adm = _state_with(running, [job("p1", 5, 10, gpus_per_pod=8, estimate=600)], now=5.0)
    view = {"r1": RunningView(running[0].spec(), started_at=0.0)}
    model = EtaModel()
    assert estimate_ranges(cluster, adm, view, 5.0, model)["p1"].start == 3600.0
    for i in range(10):  # jobs of team a take a quarter of their limit
        model.job_finished(job(f"old-{i}", 0, 10, estimate=3600).spec(), 900.0)
    eta = estimate_ranges(cluster, adm, view, 5.0, model)["p1"]
    assert eta.start == pytest.approx(900.0, abs=1)
    assert eta.low <= eta.start <= eta.high


def test_a_running_sweep_is_expected_to_end_with_its_ended_cohort_and_its_peers_are_its_groups_only():
    """Thirty jobs of team a started within 30 s; twenty ended after 1,000 s (limits 8 h). The ETA expects the
    ten still running at 1,030 s to end within minutes, where the window alone (team a's long history) says hours; the
    peers each is predicted with are the running jobs of its own group, never another team's."""
    model = EtaModel()
    for i in range(40):  # team a's window: jobs that ran 1 h to 8 h, long ago
        model.job_finished(job(f"old-{i}", 0, 10, estimate=28800).spec(), 3600.0 + 600.0 * i, ended_at=-1e6 + i)
        model.job_finished(job(f"old-b-{i}", 0, 10, estimate=28800, team="b").spec(), 7200.0, ended_at=-1e6 + i)
    sweep = [RunningView(job(f"s-{i}", 0, 10, estimate=28800).spec(), started_at=float(i)) for i in range(30)]
    other = RunningView(job("b-1", 0, 10, estimate=28800, team="b").spec(), started_at=0.0)
    running = {v.spec.job_id: v for v in sweep[20:]} | {"b-1": other}
    now = 1030.0
    before = model.all_expected_ends(running, now)
    for v in sweep[:20]:
        model.job_finished(v.spec, 1000.0, ended_at=v.started_at + 1000.0)
    after = model.all_expected_ends(running, now)
    for v in sweep[20:]:
        assert before[v.spec.job_id][1] - now > 3600  # the window: hours
        assert after[v.spec.job_id][1] - now < 600  # the cohort: minutes
    assert after["b-1"] == before["b-1"]  # team b (its own window) has no cohort; team a's are not its peers
    # another team's running job beside them changes none of team a's predictions; team a's own do
    more_b = RunningView(job("b-2", 0, 10, estimate=3600, team="b").spec(), started_at=25.0)
    with_b2 = model.all_expected_ends(running | {"b-2": more_b}, now)
    assert all(with_b2[j] == after[j] for j in after if j.startswith("s-"))
    assert with_b2["b-1"] != after["b-1"]  # (b-2 is b-1's peer)
    # the refresh handed the predictor team a's running jobs as one group: s-20's peers are s-21 to s-29
    model.all_expected_ends(running, now)
    group = model.predictor.group_name(JobKey.of(running["s-20"].spec))
    peers = model.predictor._running_peers(group, 28800.0, 20.0, now - 20.0)
    assert sorted(s for _, s, _ in peers) == [float(i) for i in range(21, 30)]


def test_a_running_sweep_none_of_which_has_ended_is_expected_to_end_together():
    """Thirty jobs of team a started within 30 s, none ended; their users typed limits of 1 h to 4 h. Alone,
    each is expected to end in proportion to its limit; the ETA's refresh hands the running jobs to the
    predictor (`running_now`), and their limits together place every one near the same end."""
    rng = random.Random(3)
    model = EtaModel()
    for i in range(60):  # team a's window: limits the users' noisy guesses of durations from 10 min to 5 h
        d = rng.uniform(600, 18000)
        limit = int(d * rng.lognormvariate(0.4, 0.6)) + 1
        model.job_finished(job(f"old-{i}", 0, 10, estimate=limit).spec(), d, ended_at=-1e6 + i)
    limits = [3600, 7200, 14400]
    sweep = {f"s-{i}": RunningView(job(f"s-{i}", 0, 10, estimate=limits[i % 3]).spec(), started_at=float(i))
             for i in range(30)}
    now = 1800.0
    alone = {j: model.expected_ends(v, now)[1] - v.started_at for j, v in sweep.items()}
    together = {j: e[1] - sweep[j].started_at for j, e in model.all_expected_ends(sweep, now).items()}
    assert max(alone.values()) / min(alone.values()) > 2.5
    assert max(together.values()) / min(together.values()) < 1.5
    model.predictor.running_now([])
    assert {j: model.expected_ends(v, now)[1] - v.started_at for j, v in sweep.items()} == alone


def _calibrated_coverage(cal: EtaCalibration, rng: random.Random, steps: int, spread_of) -> dict[str, float]:
    """Feed `cal` ETAs whose replayed range is `spread_of(kind)` wide (log, each side) while the actual wait is
    lognormal around the planned one with the kind's true sigma; the coverage per kind after a warm-up."""
    sigma = {"calm": 0.1, "wild": 0.8}
    hits = {"calm": 0, "wild": 0}
    total = {"calm": 0, "wild": 0}
    for i in range(steps):
        now = float(i * 100)
        kind = "calm" if i % 2 else "wild"
        wait = rng.uniform(1_000, 5_000)
        w = spread_of(kind)
        planned, low, high = now + wait, now + wait * math.exp(-w), now + wait * math.exp(w)
        actual = now + wait * rng.lognormvariate(0, sigma[kind])
        eta = cal.calibrated("q", now, planned, low, high, submitted_at=now)
        assert eta.low <= eta.start == planned <= eta.high  # the start is the replay's, the range holds it
        if i >= steps // 4:
            total[kind] += 1
            hits[kind] += eta.low <= actual <= eta.high
        cal.record("q", now, eta, actual, submitted_at=now)
    return {k: hits[k] / total[k] for k in hits}


def test_conformal_range_holds_the_nominal_share_whatever_the_replayed_range_says():
    """Replayed ranges that say the right shape but the wrong width (a tenth of the noise, or five times it):
    calibrated, the p10-p90 range holds about 80% of starts. Replayed ranges that follow each job's noise keep
    about 80% for calm and wild jobs alike (the margin is added to the replayed range, not one width for all:
    a width from the pooled errors would hold nearly all calm starts and too few wild ones)."""
    z80 = 1.2816
    narrow = _calibrated_coverage(EtaCalibration(window=400), random.Random(7), 3000, lambda k: 0.01)
    wide = _calibrated_coverage(EtaCalibration(window=400), random.Random(8), 3000, lambda k: 3.0)
    both = _calibrated_coverage(EtaCalibration(window=400), random.Random(9), 3000,
                                lambda k: z80 * (0.1 if k == "calm" else 0.8))
    for cov in (narrow, wide):
        assert 0.72 <= (cov["calm"] + cov["wild"]) / 2 <= 0.88
    assert 0.72 <= both["calm"] <= 0.9 and 0.72 <= both["wild"] <= 0.9
    uncalibrated = _calibrated_coverage(EtaCalibration(window=400, min_samples=400), random.Random(7), 300,
                                        lambda k: 0.01)
    assert uncalibrated["wild"] < 0.1  # (the record never stood in: the replayed range as is)


def test_conformal_quantile_is_the_finite_sample_one():
    from services.core.eta import conformal_quantile

    scores = [float(i) for i in range(1, 10)]  # n = 9: ceil(10 * 0.8) = 8th smallest
    assert conformal_quantile(scores, 0.8) == 8.0
    assert conformal_quantile(scores[:3], 0.8) is None  # ceil(4 * 0.8) = 4 > 3: no finite margin yet
    assert conformal_quantile([], 0.8) is None
    with pytest.raises(ValueError, match="min_samples"):
        EtaCalibration(window=10, min_samples=20)


def test_refresh_is_paced_by_platform_time_and_changes():
    assert refresh_due(None, 0.0, changed=False)
    assert not refresh_due(100.0, 110.0, changed=True, min_interval_s=30)  # a burst: one refresh
    assert refresh_due(100.0, 130.0, changed=True, min_interval_s=30)
    assert not refresh_due(100.0, 399.0, changed=False, interval_s=300)
    assert refresh_due(100.0, 400.0, changed=False, interval_s=300)
    # the last refresh started nobody within the horizon: time alone refreshes at the horizon's resolution
    assert not refresh_due(100.0, 400.0, changed=False, interval_s=300, all_beyond=True)
    assert refresh_due(100.0, 100.0 + IDLE_REFRESH_S, changed=False, all_beyond=True)
    assert refresh_due(100.0, 130.0, changed=True, min_interval_s=30, all_beyond=True)  # a change: as before


def _busy_trace():
    rng = random.Random(3)
    jobs = []
    for i in range(120):  # a queue that builds up on one 8-GPU node; limits 2-4x the true duration
        duration = int(rng.uniform(600, 2_400))
        jobs.append(job(f"train-{i:03d}", i * 200, duration, gpus_per_pod=rng.choice((1, 2, 4)),
                        team=rng.choice(("a", "b")), estimate=int(duration * rng.uniform(2, 4))))
    return trace(jobs)


def test_tracked_replay_reports_accuracy_and_never_shows_the_ETA_a_true_duration():
    tr = _busy_trace()
    tracked = EtaTracked(make_policy("gpuq"))
    seen: list[float] = []
    ended: dict[str, float] = {}
    original = tracked.model.job_finished

    def spy(spec, ran_s, ended_at=None):  # every duration the model learns is one of a job that has ended
        seen.append(ran_s)
        ended[spec.job_id] = ended_at
        original(spec, ran_s, ended_at)

    tracked.model.job_finished = spy  # type: ignore[method-assign]  # observe what the model is fed
    result = Engine(tr, tracked).run()
    m = eta_metrics(tracked, result)
    assert m["eta_jobs"] > 10 and m["eta_jobs"] == m["eta_jobs_mid"]
    for k in ("eta_within_20pct", "eta_within_50pct", "eta_interval_coverage"):
        assert 0.0 <= m[k] <= 1.0 and 0.0 <= m[k + "_mid"] <= 1.0
    durations = {j.job_id: j.duration for j in tr.jobs}
    assert len(seen) == len(durations) and sorted(seen) == pytest.approx(sorted(durations.values()))
    # cohort evidence (a job's start and run time) arrives when the job has ended, at its end, never before
    assert ended == {j: result.records[j].end for j in durations}
    # the ETAs were given before the job ended: the log holds only jobs' waits
    assert all(given_at < (result.records[j].start or 0)
               for j, log in tracked.logs.items() for given_at, _ in log.given)


def test_predicted_etas_beat_limit_etas_on_a_workload_whose_limits_overstate():
    tr = _busy_trace()
    scores = {}
    for predict in (False, True):
        tracked = EtaTracked(make_policy("gpuq"), EtaModel(predict=predict, calibrate=predict))
        scores[predict] = eta_metrics(tracked, Engine(tr, tracked).run())
    assert scores[True]["eta_abs_error_p50_frac"] < scores[False]["eta_abs_error_p50_frac"]
    assert scores[False]["eta_bias_p50_frac"] > 0  # limits: late


def test_simulate_eta_option_adds_the_metrics(tmp_path):
    path = tmp_path / "trace.csv"
    rows = ["job_id,submit_time,duration,gpus,team,priority_class,gpu_model,max_runtime_s"]
    rows += [f"j{i},{i * 60},{600 + 60 * (i % 7)},{(1, 2, 4)[i % 3]},t,normal,H100,{3 * (600 + 60 * (i % 7))}"
             for i in range(60)]
    path.write_text("\n".join(rows) + "\n")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("node_groups:\n  - {name: h, count: 1, gpus_per_node: 8, gpu_model: H100, cpu_milli: 96000,"
                       " memory_mib: 1048576}\n")
    out = tmp_path / "out.json"
    res = CliRunner().invoke(app, ["simulate", "--trace", str(path), "--cluster", str(cluster), "--policy",
                                   "gpuq,quota-fifo", "--eta", "predicted", "--json", str(out)])
    assert res.exit_code == 0, res.output
    gpuq, fifo = json.loads(out.read_text())["results"]
    assert gpuq["eta_jobs"] > 0 and "eta_interval_coverage_mid" in gpuq
    assert "eta_jobs" not in fifo  # quota-fifo gives no ETAs
    res = CliRunner().invoke(app, ["simulate", "--trace", str(path), "--cluster", str(cluster), "--eta", "maybe"])
    assert res.exit_code == 2 and "ETA mode" in res.output


def test_platform_eta_learns_from_the_starts_and_ends_admission_reports():
    """The admission service's ETA object: predicted from reserved ends, calibrated by reported starts."""
    from services.eta.platform import PlatformEta

    running = [job("r1", 0, 10, gpus_per_pod=6, estimate=3600)]
    cluster, adm = _state_with(running, [job("p1", 5, 10, gpus_per_pod=8, estimate=600)], now=5.0)
    eta = PlatformEta()
    assert eta(cluster, adm, {"r1": 3600.0}, 5.0)["p1"].start == 3600.0  # no history: limits
    for i in range(10):
        eta.job_finished(job(f"old-{i}", 0, 10, estimate=3600).spec(), 1800.0)
    eta.job_finished(job("never-ran", 0, 10, estimate=3600).spec(), None)  # a cancel before start teaches nothing
    assert eta.model.predictor.observed == 10
    got = eta(cluster, adm, {"r1": 3600.0}, 5.0)["p1"]
    assert got.start == pytest.approx(1800.0, abs=1)
    # another cohort's running job (its spec unknown here) keeps its reserved end
    assert eta(cluster, adm, {"r1": 3600.0, "elsewhere": 50.0}, 5.0)["p1"].start == pytest.approx(1800.0, abs=1)
    eta.job_started("p1", 2400.0)
    assert eta.accuracy()["a"]["count"] == 2.0  # the first ETA and the one in force halfway
    assert eta.refresh_due(None, 0.0, False) and not eta.refresh_due(0.0, 10.0, True)
    assert eta.refresh_due(0.0, 400.0, False)
    # a job holding the node for 10 days: p1 is beyond the horizon, no ETA, and time alone refreshes rarely
    eta = PlatformEta()  # (no history: r1 runs to its reserved end)
    cluster, adm = _state_with([job("r1", 0, 10, gpus_per_pod=6, estimate=10 * 86_400)],
                               [job("p1", 5, 10, gpus_per_pod=8, estimate=600)], now=5.0)
    assert eta(cluster, adm, {"r1": 10 * 86_400.0}, 5.0) == {}
    assert not eta.refresh_due(5.0, 405.0, False) and eta.refresh_due(5.0, 35.0, True)


def test_platform_eta_preempts_in_its_replays_and_remembers_who_was_preempted():
    """The admission service's ETA replays the platform's preemptions: a normal job waiting behind a low-priority
    one past its protection window starts now; once admission reports the waiting job preempted (JobPreempted),
    its cool-down keeps it from preempting until 600 s after that preemption; a start forgets it."""
    from services.eta.platform import PlatformEta

    running = [job("low", 0, 10, gpus_per_pod=8, estimate=7200, priority="low")]
    cluster, adm = _state_with(running, [job("p1", 5, 10, gpus_per_pod=8, estimate=600)], now=1000.0)
    eta = PlatformEta()
    assert eta(cluster, adm, {"low": 7200.0}, 1000.0)["p1"].start == 1000.0
    eta.job_preempted("p1", 900.0)
    assert eta(cluster, adm, {"low": 7200.0}, 1000.0)["p1"].start == 1500.0
    forked, _, _ = eta.replay_forked(cluster, adm, {"low": 7200.0}, 1000.0)
    assert forked["p1"].start == 1500.0  # the forked refresh reads the same memory
    eta.job_started("p1", 7200.0)
    assert eta(cluster, adm, {"low": 7200.0}, 1000.0)["p1"].start == 1000.0
    off = PlatformEta(EtaModel(expect_preemption=False))  # the replay without preemption: the low job's end
    assert off(cluster, adm, {"low": 7200.0}, 1000.0)["p1"].start == 7200.0


def test_a_refresh_forked_in_steps_learns_and_answers_as_one_in_a_single_call():
    """The service's forked refresh (replay_forked in the child, on its copies; learn and remember in the
    service's process) must leave the same arrival history and memory, and give the same ETAs, as a refresh in
    one call; the child's copies change nothing of the parent's on their own."""
    import copy

    from services.eta.platform import PlatformEta

    running = [job("r1", 0, 10, gpus_per_pod=6, estimate=3600)]
    cluster, adm = _state_with(running, [job("p1", 5, 10, gpus_per_pod=8, estimate=600),
                                         job("p2", 6, 10, gpus_per_pod=2, estimate=600, priority="high")], now=6.0)
    whole, forked = PlatformEta(), PlatformEta()
    for eta in (whole, forked):
        for i in range(5):
            eta.job_finished(job(f"old-{i}", 0, 10, estimate=3600).spec(), 1200.0)
    want = whole(cluster, adm, {"r1": 3600.0}, 6.0)
    # what a fork gives the child: copies of the model, the cluster and the state
    child, child_cluster, child_adm = PlatformEta(copy.deepcopy(forked.model)), copy.deepcopy(cluster), adm.copy()
    got, arrivals, queued = child.replay_forked(child_cluster, child_adm, {"r1": 3600.0}, 6.0)
    assert len(forked.model.arrivals) == 0  # the child's learning stayed in the child
    forked.learn(arrivals, 6.0)
    forked.remember(got, queued, 6.0)
    assert got == want and want
    assert forked.model.arrivals._seen == whole.model.arrivals._seen and len(forked.model.arrivals) == 3
    assert forked._given == whole._given and forked._queued == whole._queued


def _stream(model: EtaModel, queue: str, priority: int, every_s: float, until: float, span_s: float,
            gpu_s: float) -> float:
    """Arrivals of `queue` every `every_s` over (until - span_s, until]; returns their GPU-seconds in all."""
    from services.core.eta import Arrival

    n = int(span_s // every_s)
    for i in range(n):
        at = until - i * every_s
        model.arrivals.observe(queue, Arrival(at, f"s-{queue}-{priority}-{i}", priority, gpu_s), now=until)
    return n * gpu_s


def _low_job_waiting(now: float):
    """r1 holds 6 of the node's 8 GPUs until 3600; p1 (low, 8 GPUs) waits for it."""
    running = [job("r1", 0, 10, gpus_per_pod=6, estimate=3600)]
    cluster, adm = _state_with(running, [job("p1", 5, 10, gpus_per_pod=8, estimate=600, priority="low")], now=now)
    return cluster, adm, {"r1": RunningView(running[0].spec(), started_at=0.0)}


def test_a_steady_stream_of_higher_priority_arrivals_delays_a_low_priority_eta_by_what_it_takes():
    """A queue that received a 1-GPU, 480 s high-priority job every minute over the last hour (the replay's
    wait of p1) is expected to go on: that hour of arrivals is 28,800 GPU-seconds, 3,600 s of the 8-GPU pool,
    and p1's start moves that much later. Without arrivals the ETA is the replay's; an equal-priority or a
    lower-priority stream, or another queue's, does not overtake p1; a stream that stopped long ago adds
    (nearly) nothing."""
    now = 5.0
    cluster, adm, view = _low_job_waiting(now)
    plain = estimate_ranges(cluster, adm, view, now, EtaModel())["p1"]
    assert plain.start == 3600.0  # no history: r1 runs its limit, and nothing arrived
    off = estimate_ranges(cluster, adm, view, now, EtaModel(expect_arrivals=False))["p1"]
    assert off == plain

    model = EtaModel()
    work = _stream(model, "a", 500, 60.0, now, 3600.0, 480.0)
    eta = estimate_ranges(cluster, adm, view, now, model)["p1"]
    assert eta.start == pytest.approx(3600.0 + work / 8, rel=0.02)
    assert eta.low <= eta.start <= eta.high

    for queue, priority in (("a", 0), ("other", 500)):
        quiet = EtaModel()
        _stream(quiet, queue, priority, 60.0, now, 3600.0, 480.0)
        assert estimate_ranges(cluster, adm, view, now, quiet)["p1"].start == 3600.0
    ended = EtaModel()  # the same sweep, submitted in the first ten minutes of the hour, then silence
    _stream(ended, "a", 500, 10.0, now - 3000.0, 600.0, 480.0)
    assert estimate_ranges(cluster, adm, view, now, ended)["p1"].start == pytest.approx(3600.0, abs=1.0)


def test_only_the_share_of_an_arrivals_work_on_a_jobs_gpu_models_delays_it():
    """Pools of 8 A and 24 B GPUs. A high-priority arrival for B only never delays a job that runs on A only;
    one that accepts any model spreads over the 32 GPUs, so a quarter of its work lands on A; one for A only
    counts whole. A job that accepts any model meets all of them over the 32 GPUs. The silence weight counts
    the arrivals that compete (two for the A job, three for the any-model one)."""
    from services.core.eta import Arrival, ArrivalHistory

    pools, now, wait = {"A": 8, "B": 24}, 1000.0, 600.0
    hist = ArrivalHistory()
    for job_id, models, gpu_s in (("b-only", ("B",), 800.0), ("any", (), 3200.0), ("a-only", ("A",), 800.0)):
        hist.observe("q", Arrival(now - 10.0, job_id, 500, gpu_s, models), now=now)
    assert hist.expected_delay("q", 0, now, wait, pools, ("A",)) == pytest.approx(
        (3200.0 / 4 + 800.0) / 8 * math.exp(-2 * 10.0 / wait))
    assert hist.expected_delay("q", 0, now, wait, pools, ("B",)) == pytest.approx(
        (800.0 + 3200.0 * 3 / 4) / 24 * math.exp(-2 * 10.0 / wait))
    assert hist.expected_delay("q", 0, now, wait, pools, ()) == pytest.approx(
        4800.0 / 32 * math.exp(-3 * 10.0 / wait))
    only_b = ArrivalHistory()
    only_b.observe("q", Arrival(now - 10.0, "b-only", 500, 800.0, ("B",)), now=now)
    assert only_b.expected_delay("q", 0, now, wait, pools, ("A",)) == 0.0


def test_an_arrivals_work_counts_its_mig_slices_as_their_share_of_a_gpu():
    """A job of four 3g.40gb slices holds 4 x 3/7 of a GPU (the domain's share of a slice), not zero GPUs;
    whole GPUs count as they are."""
    from dataclasses import replace

    from services.core.eta import gpu_share
    from shared.domain import MIG_COMPUTE_SLICES

    sliced = replace(job("m", 0, 60, pods=4), mig_profile="3g.40gb").spec()
    assert sliced.total_gpus == 0
    assert gpu_share(sliced) == pytest.approx(4 * (1000 * 3 // MIG_COMPUTE_SLICES) / 1000)
    assert gpu_share(job("w", 0, 60, pods=2, gpus_per_pod=4).spec()) == 8


def test_the_arrival_history_learns_each_job_once_from_refreshes_and_stays_bounded():
    """observe_arrivals records every job admission holds (pending and admitted), with its priority and
    predicted work, once however many refreshes see it; entries older than the horizon are forgotten, and a
    queue keeps at most `max_entries`."""
    from services.core.eta import Arrival, ArrivalHistory
    from services.eta.platform import PlatformEta

    cluster, adm, _ = _low_job_waiting(5.0)
    model = EtaModel()
    model.observe_arrivals(adm, 5.0)
    model.observe_arrivals(adm, 65.0)
    assert len(model.arrivals) == 2  # r1 and p1, once each
    assert [(a.job_id, a.priority, a.gpu_s) for a in model.arrivals.overtaking("a", -1, -1.0, 65.0)] == [
        ("r1", 100, 6 * 3600.0), ("p1", 0, 8 * 600.0)]
    assert [a.job_id for a in model.arrivals.overtaking("a", 0, -1.0, 65.0)] == ["r1"]

    hist = ArrivalHistory(max_age_s=1000.0, max_entries=3)
    for i in range(5):
        hist.observe("a", Arrival(float(i * 100), f"j{i}", 1, 1.0), now=float(i * 100))
    assert [a.job_id for a in hist.overtaking("a", 0, -1.0, 500.0)] == ["j2", "j3", "j4"]
    hist.observe("a", Arrival(2000.0, "late", 1, 1.0), now=2000.0)
    assert [a.job_id for a in hist.overtaking("a", 0, -1.0, 2000.0)] == ["late"] and len(hist) == 1
    hist.observe("a", Arrival(500.0, "old", 1, 1.0), now=2000.0)  # older than the history: never counted
    assert len(hist) == 1
    import copy

    snapshot = copy.deepcopy(hist)  # (PlatformEta replays on a copy of its model)
    hist.observe("a", Arrival(2100.0, "after", 1, 1.0), now=2100.0)
    assert len(snapshot) == 1 and len(hist) == 2
    assert [a.job_id for a in snapshot.overtaking("a", 0, -1.0, 2100.0)] == ["late"]

    eta = PlatformEta()  # the service's ETA feeds the history at each refresh
    eta(cluster, adm, {"r1": 3600.0}, 5.0)
    assert len(eta.model.arrivals) == 2


def test_the_replay_gives_the_freed_gpus_to_the_preemptor_as_the_scheduler_holds_them():
    """Issue 51 in the ETA's replay: team A's high job preempts team A's low job, while team B's job of the same
    priority, admitted earlier, waits for GPUs. The scheduler holds the freed node for the preemptor
    (docs/preemption.md), so the replay starts a-high at once and b-job after it; without the hold it gave the node
    to b-job, first in the placement order, and told a-high it would wait for b-job's end."""
    from services.core.scheduler import ClusterState, PendingJob, schedule_cycle

    cluster = ClusterState.from_nodes(nodes(1))
    adm = AdmissionState(queues_for_teams(["a", "b"], {"gpu": 8}, nominal={"a": 8, "b": 8}))
    low = job("a-low", 0, 10, gpus_per_pod=8, estimate=7200, priority="low")
    assert adm.submit(Workload(spec=low.spec(), submitted_at=0.0)) is None
    decision = admission_cycle(adm, 0.0)
    assert len(schedule_cycle(cluster, [PendingJob(spec=a.spec) for a in decision.admitted], [], 0.0).placed) == 1
    b = job("b-job", 5, 10, gpus_per_pod=8, estimate=1000, team="b", priority="high")
    assert adm.submit(Workload(spec=b.spec(), submitted_at=5.0)) is None
    assert [a.spec.job_id for a in admission_cycle(adm, 5.0).admitted] == ["b-job"]  # quota only: no GPU for it
    high = job("a-high", 700, 10, gpus_per_pod=8, estimate=500, priority="high")
    assert adm.submit(Workload(spec=high.spec(), submitted_at=700.0)) is None
    # a-low started at 0 is past its 600 s protection window at 700
    etas = estimate_starts(cluster, adm, {"a-low": 7200.0}, now=700.0, started={"a-low": 0.0})
    assert etas["a-high"] == 700.0
    assert etas["b-job"] == 1200.0  # after a-high's 500 s
