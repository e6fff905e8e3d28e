"""The telemetry core folds events into gauges and observations: scenarios and invariants."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.telemetry.names import METRICS
from services.core.telemetry.state import Observation, TelemetryState, labels
from shared.config import parse_queues
from shared.domain import NodeHealth, NodeUsage
from shared.events import (
    ExitReason,
    JobAdmitted,
    JobCancelled,
    JobCompleted,
    JobQueued,
    JobRequeued,
    JobSubmitted,
    NodeChanged,
    Payload,
)
from tests.unit.telemetry.telemetry_builders import T0, at, checkpointed, inventory, life, node, preempted, sample, spec


def run(state: TelemetryState, events: list[tuple[float, Payload]]) -> list[Observation]:
    out: list[Observation] = []
    for t, p in sorted(events, key=lambda e: e[0]):
        out.extend(state.apply(p, T0 + t).observations)
    return out


def find(obs: list[Observation], name: str) -> list[Observation]:
    return [o for o in obs if o.name == name]


def test_running_and_waiting_jobs_show_in_the_gauges() -> None:
    s = TelemetryState()
    s.apply(inventory(node("n0"), node("n1"), node("i0", pool="inference", model="L4")), T0)
    big = spec("big", team="team-a", pods=1, gpus_per_pod=4)
    run(s, life(big, {"n0": [0, 1, 2, 3]}, t_submit=0, wait=60, run=10_000, util=50, end=None))
    waiting = spec("waiting", team="team-b", pods=2, gpus_per_pod=8, models=("H100",))
    run(s, life(waiting, {}, t_submit=10, wait=10_000, run=1, end=None)[:2])  # submitted + pending only

    g = s.gauges(T0 + 100)
    key = labels(queue="team-a", team="team-a", pool="training", gpu_model="H100")
    assert g["gpuq_gpus_allocated"] == {key: 4}
    assert g["gpuq_gpus_used"] == {key: 2.0}  # 4 GPUs at 50%
    assert g["gpuq_gpu_memory_used_bytes"][key] == 4 * 40_000 * 1024 * 1024
    assert g["gpuq_running_jobs"] == {labels(queue="team-a", team="team-a"): 1}
    assert g["gpuq_pending_jobs"] == {
        labels(queue="team-b", team="team-b", stage="admission", reason="QuotaExhausted"): 1}
    train = labels(pool="training", gpu_model="H100")
    assert g["gpuq_gpus_capacity"][train] == 16
    assert g["gpuq_gpus_free"][train] == 12
    # The waiting gang needs two whole free H100 nodes; only n1 is whole: n0's 4 free GPUs fit nobody, and
    # the gang as a whole does not fit, so nothing it could use counts as usable.
    assert g["gpuq_gpus_fragmented"][train] == 12
    assert g["gpuq_gpus_fragmented"][labels(pool="inference", gpu_model="L4")] == 8
    assert g["gpuq_node_gpu_allocated"][labels(node="n0", gpu="2", queue="team-a", team="team-a")] == 1
    assert g["gpuq_job_pending_info"] == {labels(job_id="waiting", queue="team-b", team="team-b",
                                                 stage="admission", reason="QuotaExhausted"): 1}
    assert g["gpuq_job_eta_timestamp_seconds"][labels(job_id="waiting", queue="team-b", team="team-b")] == \
        T0 + 10 + 10_000
    assert g["gpuq_job_gpu_utilization_ratio"][labels(job_id="big", queue="team-a", team="team-a")] == 0.5


def test_admission_wait_completion_time_and_outcomes_are_observed() -> None:
    s = TelemetryState()
    s.apply(inventory(node("n0")), T0)
    ok = spec("ok", team="team-a", priority="high")
    oom = spec("oom", team="team-b")
    obs = run(s, life(ok, {"n0": [0]}, t_submit=0, wait=120, run=3600)
              + life(oom, {"n0": [1]}, t_submit=5, wait=15, run=100, end=ExitReason.OOM_KILLED))
    waits = {o.labels: o.value for o in find(obs, "gpuq_admission_wait_seconds")}
    assert waits == {labels(queue="team-a", priority_class="high"): 120.0,
                     labels(queue="team-b", priority_class="normal"): 15.0}
    jct = {o.labels: o.value for o in find(obs, "gpuq_job_completion_seconds")}
    assert jct[labels(queue="team-a", priority_class="high", exit_reason="Succeeded")] == 120 + 3600
    assert jct[labels(queue="team-b", priority_class="normal", exit_reason="OOMKilled")] == 15 + 100
    assert [o.labels for o in find(obs, "gpuq_oom_kills")] == [labels(queue="team-b", team="team-b")]
    # Finished jobs leave no gauge behind.
    g = s.gauges(T0 + 10_000)
    assert "gpuq_gpus_allocated" not in g and "gpuq_running_jobs" not in g
    assert g["gpuq_gpus_free"][labels(pool="training", gpu_model="H100")] == 8


def test_a_backdated_submitted_at_moves_no_wait() -> None:
    """The producer's submitted_at is a claim (issue 43: one 7.9 years old moved the wait metric by as much):
    waits count from when the platform received the job, which JobAdmitted carries from admission."""
    s = TelemetryState()
    s.apply(inventory(node("n0")), T0)
    job = spec("old", team="team-a")
    claimed = datetime(2018, 2, 1, tzinfo=UTC)
    s.apply(JobSubmitted(spec=job, submitted_at=claimed), T0)
    assert s.gauges(T0 + 10)["gpuq_job_waiting_seconds"] == {labels(job_id="old", queue="team-a", team="team-a"): 10}
    obs = run(s, [(2, JobQueued(job_id="old", queue="team-a", team="team-a")),
                  (40, JobAdmitted(job_id="old", spec=job, submitted_at=at(1), admitted_at=at(40))),
                  (100, JobCompleted(job_id="old", finished_at=at(100)))])
    assert [o.value for o in find(obs, "gpuq_admission_wait_seconds")] == [39.0]  # from admission's receipt
    assert [o.value for o in find(obs, "gpuq_job_completion_seconds")] == [99.0]


def test_preemption_counts_frees_gpus_and_restarts_the_wait_clock() -> None:
    s = TelemetryState()
    s.apply(inventory(node("n0")), T0)
    victim = spec("victim", team="team-a", gpus_per_pod=8)
    run(s, life(victim, {"n0": list(range(8))}, t_submit=0, wait=10, run=1, end=None))
    fx = s.apply(preempted("victim", 500, lost=240.0), T0 + 500)
    assert {(o.name, o.labels, o.value) for o in fx.observations} == {
        ("gpuq_preemptions", labels(queue="team-a", reason="ReclaimQuota"), 1.0),
        ("gpuq_preemption_lost_gpu_seconds", labels(queue="team-a", reason="ReclaimQuota"), 240.0)}
    g = s.gauges(T0 + 501)
    assert g["gpuq_gpus_free"][labels(pool="training", gpu_model="H100")] == 8
    assert g["gpuq_pending_jobs"] == {labels(queue="team-a", team="team-a", stage="admission", reason="Preempted"): 1}
    s.apply(JobRequeued(job_id="victim", spec=victim, submitted_at=at(0)), T0 + 502)
    fx = s.apply(JobAdmitted(job_id="victim", spec=victim, admitted_at=at(800)), T0 + 800)
    (wait,) = find(fx.observations, "gpuq_admission_wait_seconds")
    assert wait.value == 300.0  # from the preemption, not from the first submission
    fx = s.apply(JobCancelled(job_id="victim", by="alice", cancelled_at=at(900)), T0 + 900)
    (jct,) = find(fx.observations, "gpuq_job_completion_seconds")
    assert jct.value == 900.0  # completion time still counts from the first submission


def test_checkpoint_age_is_the_oldest_among_running_checkpointable_jobs() -> None:
    s = TelemetryState()
    s.apply(inventory(node("n0")), T0)
    run(s, life(spec("a"), {"n0": [0]}, t_submit=0, wait=0, run=1, end=None))
    run(s, life(spec("b"), {"n0": [1]}, t_submit=0, wait=0, run=1, end=None))
    run(s, life(spec("nock", checkpoint=False), {"n0": [2]}, t_submit=0, wait=0, run=1, end=None))
    s.apply(checkpointed("a", 1000), T0 + 1000)
    s.apply(checkpointed("b", 400), T0 + 400)
    g = s.gauges(T0 + 1200)
    assert g["gpuq_checkpoint_age_max_seconds"] == {labels(queue="team-a"): 1200 - 400}


def test_stale_samples_stop_reporting_and_unhealthy_nodes_leave_capacity() -> None:
    s = TelemetryState()
    s.apply(inventory(node("n0"), node("bad", health=NodeHealth.FAILED)), T0)
    s.apply(sample("n0", {0: (None, 3.0)}, 0, interval=30), T0)
    assert labels(node="n0", gpu="0", pool="training", gpu_model="H100") in \
        s.gauges(T0 + 60)["gpuq_node_gpu_utilization_ratio"]
    assert "gpuq_node_gpu_utilization_ratio" not in s.gauges(T0 + 91)  # > 3 intervals old
    g = s.gauges(T0)
    assert g["gpuq_gpus_capacity"][labels(pool="training", gpu_model="H100")] == 8
    assert g["gpuq_nodes"][labels(pool="training", gpu_model="H100", health="failed")] == 1


def test_gpus_held_outside_gpuq_are_reported_per_node_and_pool_and_are_not_free() -> None:
    """Pods gpuq does not manage hold 6 GPUs of n1 and 2 MIG slices of n2 (NodeSpec.held, from the executor's
    NodeInventory / NodeChanged): per node, per pool, and not free; when they go, the node's series goes too."""
    s = TelemetryState()
    held = node("n1").model_copy(update={"held": NodeUsage(gpus=6, pods=1)})
    mig = node("n2").model_copy(update={"held": NodeUsage(mig_slices=2, pods=2)})
    s.apply(inventory(held, mig, node("n3", model="A100")), T0)
    g = s.gauges(T0)
    h100, a100 = labels(pool="training", gpu_model="H100"), labels(pool="training", gpu_model="A100")
    assert g["gpuq_node_gpus_held_outside"] == {labels(node="n1", pool="training", gpu_model="H100"): 6}
    assert g["gpuq_node_mig_slices_held_outside"] == {labels(node="n2", pool="training", gpu_model="H100"): 2}
    assert g["gpuq_gpus_held_outside"] == {h100: 6, a100: 0}
    assert g["gpuq_gpus_capacity"][h100] == 16 and g["gpuq_gpus_free"][h100] == 10
    s.apply(NodeChanged(node=node("n1"), reason="PodsChanged"), T0 + 1)
    g = s.gauges(T0 + 1)
    assert "gpuq_node_gpus_held_outside" not in g and g["gpuq_gpus_held_outside"][h100] == 0
    assert g["gpuq_gpus_free"][h100] == 16


def test_queue_config_sets_guarantees_and_prices() -> None:
    s = TelemetryState()
    s.set_queues(parse_queues({
        "priority_classes": [{"name": "normal", "value": 100}],
        "queues": [{"name": "a", "quotas": {"H100": {"nominal": 48}}},
                   {"name": "b", "quotas": {"H100": {"nominal": 24}, "A100": {"nominal": 8}}}],
        "gpu_flavors": {"H100": {"cost_per_gpu_hour": 2.5}},
    }))
    g = s.gauges(T0)
    assert g["gpuq_quota_guaranteed_gpus"] == {labels(gpu_model="A100"): 8, labels(gpu_model="H100"): 72}
    assert g["gpuq_gpu_hourly_cost"] == {labels(gpu_model="H100"): 2.5}


def test_utilisation_samples_count_allocated_and_used_gpu_seconds_by_feature() -> None:
    s = TelemetryState()
    s.apply(inventory(node("n0")), T0)
    run(s, life(spec("j", feature="vision"), {"n0": [0, 1]}, 0, 0, 1, end=None)[:-1])
    fx = s.apply(sample("n0", {0: ("j", 100.0), 1: ("j", 25.0), 2: (None, 0.0)}, 60, interval=30), T0 + 60)
    got = [(o.name, o.value) for o in fx.observations]
    # one increment per series for the node (both GPUs of the job summed); the idle GPU of no job counts nothing
    assert got == [("gpuq_gpu_allocated_seconds", 60.0), ("gpuq_gpu_used_seconds", 37.5)]
    assert all(dict(o.labels)["feature"] == "vision" for o in fx.observations)


def test_webhook_team_lookup_survives_until_the_job_ends() -> None:
    s = TelemetryState()
    s.apply(JobQueued(job_id="q1", queue="team-z", team="team-z"), T0)
    done = JobCancelled(job_id="q1", by="bob")
    assert s.team_of(done) == "team-z"
    s.apply(done, T0 + 1)
    assert s.team_of(done) is None


def test_state_rebuilt_from_its_records_gives_the_same_gauges() -> None:
    s = TelemetryState()
    s.apply(inventory(node("n0"), node("n1")), T0)
    run(s, life(spec("a", gpus_per_pod=3), {"n0": [0, 1, 2]}, 0, 5, 1, end=None))
    run(s, life(spec("b", team="team-b", pods=2, gpus_per_pod=8), {}, 3, 99, 1, end=None)[:2])
    s.apply(checkpointed("a", 50), T0 + 50)
    rebuilt = TelemetryState()
    for j in sorted(s.jobs, reverse=True):  # load order must not matter
        rebuilt.load_job(s.job_doc(j) or {})
    for n in s.nodes:
        rebuilt.load_node(s.node_doc(n) or {})
    for n in s.samples:
        rebuilt.load_sample(s.sample_doc(n) or {})
    assert rebuilt.gauges(T0 + 70) == s.gauges(T0 + 70)


def test_job_records_persisted_without_their_defaults_load_back_equal() -> None:
    """The shell persists `job_json` (fields at their defaults left out): every record at every step of its life
    loads back equal, non-default spec fields (checkpoints, GPU models, several pods) included."""
    s = TelemetryState()
    s.apply(inventory(node("n0"), node("n1")), T0)
    specs = [spec("a", gpus_per_pod=3), spec("b", team="team-b", pods=2, gpus_per_pod=4, checkpoint=False,
                                               models=("H100",)), spec("c", feature="")]
    steps = [life(specs[0], {"n0": [0, 1, 2]}, 0, 5, 1, end=None), life(specs[1], {"n1": [0, 1, 2, 3]}, 3, 9, 1),
             life(specs[2], {}, 4, 99, 1, end=None)[:2]]
    seen = 0
    for t, p in sorted((e for events in steps for e in events), key=lambda e: e[0]):
        s.apply(p, T0 + t)
        for j in sorted(s.jobs):
            doc = s.job_json(j)
            assert doc is not None
            rebuilt = TelemetryState()
            rebuilt.load_job(json.loads(doc))
            assert rebuilt.jobs[j] == s.jobs[j]
            assert len(doc) < len(json.dumps(s.job_doc(j)))
            seen += 1
    assert seen > 10 and s.job_json("gone") is None


def test_job_series_are_capped_and_long_lived_series_carry_no_job_id() -> None:
    s = TelemetryState(job_series_cap=3)
    for i in range(10):
        s.apply(JobQueued(job_id=f"j{i:02d}", queue="q", team="t"), T0)
    g = s.gauges(T0 + 5)
    assert len(g["gpuq_job_pending_info"]) == 3
    assert g["gpuq_pending_jobs"] == {labels(queue="q", team="t", stage="admission", reason="Queued"): 10}
    for name, series in g.items():
        for key in series:
            assert [k for k, _ in key] == sorted(METRICS[name].labels), name
            if not name.startswith("gpuq_job_"):
                assert "job_id" not in dict(key), name


# ---------------------------------------------------------------------------- invariants

NODES = [node("n0"), node("n1"), node("n2", gpus=4), node("l0", model="L4", pool="inference")]


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[float, Payload]]:
    events: list[tuple[float, Payload]] = []
    free = {n.name: list(range(n.gpus)) for n in NODES}
    for i in range(draw(st.integers(0, 8))):
        gpus = draw(st.integers(1, 8))
        s = spec(f"j{i}", team=draw(st.sampled_from(["team-a", "team-b"])), gpus_per_pod=gpus)
        fits = [n for n in sorted(free) if len(free[n]) >= gpus]
        place = draw(st.sampled_from(fits)) if fits and draw(st.booleans()) else None
        placement = {}
        if place is not None:
            placement = {place: free[place][:gpus]}
            free[place] = free[place][gpus:]
        end = draw(st.sampled_from([None, ExitReason.SUCCEEDED, ExitReason.OOM_KILLED]))
        ev = life(s, placement, t_submit=draw(st.integers(0, 100)), wait=draw(st.integers(0, 500)),
                  run=draw(st.integers(40, 900)), util=draw(st.floats(0, 100)), end=end)
        events.extend(ev if placement else ev[:2])
        if placement and end is None and draw(st.booleans()):
            events.append((2000.0 + i, preempted(s.job_id, 2000 + i)))
    return events


@settings(max_examples=150, deadline=None)
@given(histories())
def test_free_plus_allocated_is_capacity_and_fragmentation_within_free(events: list) -> None:
    s = TelemetryState()
    s.apply(inventory(*NODES), T0)
    run(s, events)
    g = s.gauges(T0 + 5000)
    for key, capacity in g["gpuq_gpus_capacity"].items():
        pool, model = dict(key)["pool"], dict(key)["gpu_model"]
        allocated = sum(v for k, v in g.get("gpuq_gpus_allocated", {}).items()
                        if dict(k)["pool"] == pool and dict(k)["gpu_model"] == model)
        assert g["gpuq_gpus_free"][key] + allocated == capacity
        assert 0 <= g["gpuq_gpus_fragmented"][key] <= g["gpuq_gpus_free"][key]
    for series in g.values():
        assert all(v >= 0 for v in series.values())
    # Same events, fresh core: same gauges (no hidden order dependence).
    again = TelemetryState()
    again.apply(inventory(*reversed(NODES)), T0)
    run(again, events)
    assert again.gauges(T0 + 5000) == g


def test_first_etas_are_checked_against_starts_per_queue() -> None:
    """A job is scored once, on its first ETA: within ±50% of its wait, and in its range or not; a job that
    waited under 5 minutes is not scored."""
    from shared.events import JobPending, JobStarted, JobSubmitted

    s = TelemetryState()
    events: list[tuple[float, Payload]] = []
    for job_id, eta, low, high, start in (("good", 1000, 800, 1300, 1100), ("late", 1000, 900, 1100, 3000),
                                          ("quick", 100, 50, 150, 120)):
        js = spec(job_id, team="team-a")
        events += [(0, JobSubmitted(spec=js, submitted_at=at(0))),
                   (0, JobPending(job_id=job_id, queue="team-a", reason="QuotaExhausted", message="",
                                  eta=at(eta), eta_low=at(low), eta_high=at(high))),
                   # a later, different ETA does not replace the first one
                   (500, JobPending(job_id=job_id, queue="team-a", reason="QuotaExhausted", message="",
                                    eta=at(start), eta_low=at(start), eta_high=at(start))),
                   (start, JobStarted(job_id=job_id, started_at=at(start)))]
    obs = run(s, events)
    counts = {name: sum(o.value for o in find(obs, name))
              for name in ("gpuq_eta_checked", "gpuq_eta_within_50pct", "gpuq_eta_in_range")}
    assert counts == {"gpuq_eta_checked": 2, "gpuq_eta_within_50pct": 1, "gpuq_eta_in_range": 1}
    assert {o.labels for o in find(obs, "gpuq_eta_checked")} == {labels(queue="team-a")}


def test_a_retried_attempt_is_counted_frees_its_gpus_and_the_job_waits_out_its_backoff() -> None:
    from shared.events import JobAttemptFailed, JobFailed

    s = TelemetryState()
    s.apply(inventory(node("n0")), T0)
    flaky = spec("flaky", team="team-a", gpus_per_pod=8)
    run(s, life(flaky, {"n0": list(range(8))}, t_submit=0, wait=10, run=1, end=None))
    fx = s.apply(JobAttemptFailed(job_id="flaky", attempt=1, attempts_allowed=2, exit_reason=ExitReason.ERROR,
                                  finished_at=at(500), retry_not_before=at(530)), T0 + 500)
    assert {(o.name, o.labels) for o in fx.observations} == {
        ("gpuq_job_attempts_failed", labels(queue="team-a", team="team-a", exit_reason="Error"))}
    g = s.gauges(T0 + 501)
    assert g["gpuq_gpus_free"][labels(pool="training", gpu_model="H100")] == 8
    assert g["gpuq_pending_jobs"] == {
        labels(queue="team-a", team="team-a", stage="admission", reason="BackoffAfterFailure"): 1}
    fx = s.apply(JobFailed(job_id="flaky", exit_reason=ExitReason.ERROR, finished_at=at(900), attempts=2), T0 + 900)
    assert [o.labels for o in find(fx.observations, "gpuq_jobs_finished")] == [
        labels(queue="team-a", team="team-a", exit_reason="Error")]  # the job ends once
