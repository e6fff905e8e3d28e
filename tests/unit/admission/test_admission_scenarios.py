"""The seed's situations, end to end through the admission core (preemption is played by the test: it
finishes the named candidates and requeues them, as the preemption service would)."""

from __future__ import annotations

from services.core.admission import (
    AdmissionDecision,
    AdmissionState,
    Reason,
    Workload,
    admission_cycle,
)
from tests.unit.admission.admission_core_builders import A100, H100, config, job, queue, submit, submit_many


def preempt_for(s: AdmissionState, d: AdmissionDecision) -> list[str]:
    """Play the preemption service: per reclaim request, evict candidates in order until `need` is freed."""
    evicted = []
    for r in d.reclaims:
        freed = dict.fromkeys(r.need, 0)
        for victim in r.candidates:
            if all(freed[m] >= n for m, n in r.need.items()):
                break
            a = s.admitted[victim]
            for m in r.need:
                freed[m] += a.usage.get(m, 0)
            s.requeue(Workload(a.spec, a.submitted_at))
            evicted.append(victim)
    return evicted


def test_idle_gpus_are_borrowed_and_given_back_on_demand() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 16}), queue("team-b", {H100: 16})))
    # team A is idle; team B fills the whole cohort, its extra work at low priority
    submit_many(s, "team-b", 4, 4, prefix="b-own")
    submit_many(s, "team-b", 4, 4, prefix="b-extra", priority="low", t0=10)
    d = admission_cycle(s, 20.0)
    assert len(d.admitted) == 8 and s.borrowed("team-b") == {H100: 16}
    # team A comes back: its job fits its nominal quota, B's borrowed low-priority work is reclaimed
    submit(s, job("a-train", "team-a", 8), 30)
    d = admission_cycle(s, 31.0)
    [r] = d.reclaims
    assert r.need == {H100: 8} and set(r.candidates) == {f"b-extra-{i}" for i in range(4)}
    evicted = preempt_for(s, d)
    assert evicted == ["b-extra-0", "b-extra-1"]  # admitted together: by id; just enough for 8
    d = admission_cycle(s, 40.0)
    assert [a.job_id for a in d.admitted] == ["a-train"] and not d.admitted[0].borrowing
    assert d.pending["b-extra-0"].reason == Reason.WAITING_FOR_BORROWABLE_QUOTA
    # A finishes: B's preempted jobs come back first (original submit time kept)
    s.finish("a-train")
    d = admission_cycle(s, 50.0)
    assert [a.job_id for a in d.admitted] == ["b-extra-0", "b-extra-1"]


def test_a_teams_guaranteed_floor_is_always_reachable() -> None:
    """Whatever borrowers hold, a team working within its nominal quota gets it back through reclaim
    (`reclaim_within_cohort: Any`: equal-priority borrowers give back too, lowest priority first)."""
    s = AdmissionState(config(
        queue("team-a", {H100: 24}, reclaim="Any"),
        queue("team-b", {H100: 8}),
        queue("experiments", {H100: 0}),
    ))
    submit_many(s, "experiments", 20, 1, priority="low")
    submit_many(s, "team-b", 12, 2, t0=5)
    admission_cycle(s, 10.0)
    assert s.usage("team-a") == {}
    assert s.usage("team-b") == {H100: 24} and s.usage("experiments") == {H100: 8}
    submit_many(s, "team-a", 6, 4, t0=20)
    now, evicted = 21.0, []
    for _ in range(10):
        d = admission_cycle(s, now)
        evicted += preempt_for(s, d)
        now += 1
        if s.usage("team-a").get(H100, 0) == 24:
            break
    assert s.usage("team-a") == {H100: 24}  # the whole floor
    assert s.usage("team-b") == {H100: 8}  # team-b keeps its own floor; only what it borrowed went
    assert evicted[:8] == [f"experiments-{i}" for i in range(8)]  # lowest priority went first
    assert len(evicted) == 16  # nothing evicted beyond need


def test_lower_priority_reclaim_spares_equal_priority_borrowers() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}), queue("team-b", {H100: 0}),
                              queue("experiments", {H100: 0})))
    submit_many(s, "experiments", 4, 1, priority="low")
    submit_many(s, "team-b", 4, 1, t0=10)
    admission_cycle(s, 20.0)
    submit_many(s, "team-a", 8, 1, t0=30)
    d = admission_cycle(s, 31.0)
    assert {c for r in d.reclaims for c in r.candidates} == {f"experiments-{i}" for i in range(4)}
    preempt_for(s, d)
    admission_cycle(s, 32.0)
    assert s.usage("team-a") == {H100: 4}
    st = admission_cycle(s, 33.0).pending["team-a-4"]
    assert st.reason == Reason.WAITING_FOR_QUOTA and "LowerPriority" in st.message


def test_low_priority_shared_experiment_queue_soaks_up_idle_gpus_only() -> None:
    s = AdmissionState(config(
        queue("team-a", {H100: 8}),
        queue("team-b", {H100: 8}),
        queue("experiments", {H100: 0, A100: 0}, teams=()),  # open to every team, no guarantee
    ))
    for i in range(12):
        submit(s, job(f"exp-{i}", "experiments", 2, team=("team-a", "team-b")[i % 2], priority="low"), i)
    submit_many(s, "team-b", 2, 2, t0=20)
    d = admission_cycle(s, 30.0)
    # team-b's own jobs first (higher priority), experiments take the 12 idle GPUs, never more
    assert [a.job_id for a in d.admitted][:2] == ["team-b-0", "team-b-1"]
    assert s.usage("experiments") == {H100: 12} and all(a.borrowing for a in d.admitted[2:])
    st = d.pending["exp-6"]
    assert st.reason == Reason.WAITING_FOR_BORROWABLE_QUOTA and st.position_in_queue == 1
    # any team coming back gets its nominal: the experiment jobs are the reclaim candidates
    submit_many(s, "team-a", 4, 2, t0=40)
    d = admission_cycle(s, 41.0)
    # one request per job (2 GPUs each), naming disjoint victims: the experiment jobs only
    assert [(r.preemptor, r.need) for r in d.reclaims] == [(f"team-a-{i}", {H100: 2}) for i in range(4)]
    firsts = [r.candidates[0] for r in d.reclaims]
    assert len(set(firsts)) == 4 and all(c.startswith("exp-") for r in d.reclaims for c in r.candidates)


def test_weight_two_team_gets_twice_the_share_under_contention() -> None:
    s = AdmissionState(config(
        queue("lender", {H100: 30}),
        queue("heavy", {H100: 0}, weight=2),
        queue("light", {H100: 0}, weight=1),
    ))
    submit_many(s, "light", 60, 1)  # older work does not buy a bigger share
    submit_many(s, "heavy", 60, 1, t0=1000)
    admission_cycle(s, 2000.0)
    heavy, light = s.usage("heavy")[H100], s.usage("light")[H100]
    assert heavy + light == 30
    assert abs(heavy - 2 * light) <= 2, (heavy, light)
    # and it stays so while work churns: finish a third of each team's jobs, refill, re-admit
    for rnd in range(5):
        for q in ("heavy", "light"):
            mine = sorted(j for j, a in s.admitted.items() if a.spec.queue == q)
            for j in mine[: len(mine) // 3]:
                s.finish(j)
            submit_many(s, q, 10, 1, t0=3000 + rnd * 100, prefix=f"{q}-r{rnd}")
        admission_cycle(s, 3000.0 + rnd * 100 + 50)
        heavy, light = s.usage("heavy")[H100], s.usage("light")[H100]
        assert heavy + light == 30 and abs(heavy - 2 * light) <= 2, (rnd, heavy, light)


def test_gpu_model_weight_makes_an_h100_count_more_than_an_a100() -> None:
    """Fair share per dominant resource: borrowing scarce H100s raises a team's share faster."""
    s = AdmissionState(config(
        queue("lender", {H100: 10, A100: 10}),
        queue("h-team", {H100: 0, A100: 0}),
        queue("a-team", {H100: 0, A100: 0}),
        flavors={H100: 4.0, A100: 1.0},
    ))
    submit(s, job("h0", "h-team", 1, models=(H100,)), 0)
    submit_many(s, "a-team", 3, 1, models=(A100,), t0=1)
    submit(s, job("h1", "h-team", 1, models=(H100,)), 0.5)
    d = admission_cycle(s, 10.0)
    # share after admission: an H100 borrowed is 1 * 4 * 1000 / 10 = 400, an A100 100: a-team's three
    # A100s (100, 200, 300) all come before h-team's first H100 (400), its second costs 800
    assert [a.job_id for a in d.admitted] == ["a-team-0", "a-team-1", "a-team-2", "h0", "h1"]
