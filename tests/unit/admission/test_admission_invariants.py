"""Properties of the admission core over random configurations and random submit/finish/cycle sequences:
usage within nominal + borrowing limit, lending limits hold, nobody admitted twice, quota accounting exact,
max_running_jobs and capacity honoured, every pending job explained, same input -> same output."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.core.admission import AdmissionState, Workload, admission_cycle
from services.core.admission.statuses import PendingStatuses
from shared.config import QueuesConfig
from tests.unit.admission.admission_core_builders import A100, H100, config, job, quota

MODELS = (H100, A100)


@st.composite
def configs(draw: st.DrawFn) -> QueuesConfig:
    n = draw(st.integers(2, 4))
    queues = []
    for i in range(n):
        quotas: dict[str, Any] = {}
        for m in MODELS:
            if draw(st.booleans()) or (m == H100 and not quotas):
                nominal = draw(st.integers(0, 8))
                lending = draw(st.one_of(st.none(), st.integers(0, nominal)))
                quotas[m] = quota(nominal, draw(st.one_of(st.none(), st.integers(0, 6))), lending)
        queues.append({
            "name": f"q{i}",
            "cohort": draw(st.sampled_from(["c1", "c1", "c2", None])),
            "weight": draw(st.sampled_from([0, 1, 2])),
            "quotas": quotas,
            "queueing_strategy": draw(st.sampled_from(["StrictFIFO", "BestEffortFIFO"])),
            "max_running_jobs": draw(st.one_of(st.none(), st.integers(0, 4))),
            "preemption": {"within_queue": "LowerPriority",
                           "reclaim_within_cohort": draw(st.sampled_from(["Never", "LowerPriority", "Any"]))},
        })
    return config(*queues, cohorts=("c1", "c2"))


op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 3), st.integers(1, 3), st.integers(1, 2),
              st.sampled_from([(H100,), (A100,), (H100, A100), (A100, H100)]),
              st.sampled_from(["low", "normal", "high"])),
    st.tuples(st.just("finish"), st.integers(0, 10_000)),
    st.tuples(st.just("requeue"), st.integers(0, 10_000)),
    st.tuples(st.just("cycle"), st.one_of(st.none(), st.fixed_dictionaries({H100: st.integers(0, 12),
                                                                             A100: st.integers(0, 12)})),
              st.one_of(st.none(), st.integers(1, 4))),
)


def run(cfg: QueuesConfig, ops: list[tuple]) -> list[tuple]:
    """Apply the ops, checking invariants after every cycle; return everything the core said."""
    s = AdmissionState(cfg)
    queues = [q.name for q in cfg.queues]
    said: list[tuple] = []
    admitted_ever: set[str] = set()
    requeued: set[str] = set()
    now = 0.0
    n = 0
    for o in ops:
        now += 1.0
        if o[0] == "submit":
            _, qi, gpus, count, models, prio = o
            q = queues[qi % len(queues)]
            r = s.submit(Workload(job(f"j{n}", q, gpus, count=count, models=models, priority=prio), now))
            said.append(("submit", f"j{n}", r))
            n += 1
        elif o[0] in ("finish", "requeue") and s.admitted:
            ids = sorted(s.admitted)
            victim = ids[o[1] % len(ids)]
            if o[0] == "finish":
                s.finish(victim)
            else:
                a = s.admitted[victim]
                s.requeue(Workload(a.spec, a.submitted_at))
                requeued.add(victim)
        elif o[0] == "cycle":
            _, capacity, max_adm = o
            before = set(s.admitted)
            d = admission_cycle(s, now, capacity=capacity, max_admissions=max_adm)
            said.append(("cycle", d.admitted, dict(d.pending), d.reclaims))
            check(s, cfg, d, before, capacity, max_adm)
            for a in d.admitted:
                # no job admitted twice, unless it was requeued (preempted) in between
                assert a.job_id not in admitted_ever or a.job_id in requeued, a.job_id
                admitted_ever.add(a.job_id)
                requeued.discard(a.job_id)
    return said


def check(s: AdmissionState, cfg: QueuesConfig, d, before: set[str], capacity, max_adm) -> None:  # type: ignore[no-untyped-def]
    ids = [a.job_id for a in d.admitted]
    assert len(ids) == len(set(ids)) and not (set(ids) & before)
    assert not (set(s.admitted) & set(s.pending))
    assert set(d.pending) == set(s.pending)  # every pending job explained
    assert all(st.reason and st.message for st in d.pending.values())
    if max_adm is not None:
        assert len(ids) <= max_adm
    if capacity is not None:
        for m in MODELS:
            assert sum(a.usage.get(m, 0) for a in d.admitted) <= capacity.get(m, 0)
    # quota accounting is exact: usage == sum of the admitted jobs' usage
    for q in cfg.queues:
        total: dict[str, int] = {}
        running = 0
        for a in s.admitted.values():
            if a.spec.queue == q.name:
                running += 1
                for r, v in a.usage.items():
                    total[r] = total.get(r, 0) + v
        assert s.usage(q.name) == {r: v for r, v in sorted(total.items()) if v}
        if q.max_running_jobs is not None:
            assert running <= q.max_running_jobs
        for r, fq in q.quotas.items():
            used = total.get(r, 0)
            if q.cohort is None:
                assert used <= fq.nominal
            elif fq.borrowing_limit is not None:
                assert used <= fq.nominal + fq.borrowing_limit
    # lending limits: in each cohort, what borrowers take never exceeds what lenders may lend
    for c in ("c1", "c2"):
        members = [q for q in cfg.queues if q.cohort == c]
        for m in MODELS:
            borrowed = lendable = 0
            for q in members:
                fq = q.quotas.get(m)
                nominal = fq.nominal if fq else 0
                used = s.usage(q.name).get(m, 0)
                if used > nominal:
                    borrowed += used - nominal
                elif fq is not None:
                    limit = fq.lending_limit if fq.lending_limit is not None else fq.nominal
                    lendable += min(limit, nominal - used)
            assert borrowed <= lendable, (c, m, borrowed, lendable)
    # preemption requests: positive needs; victims are admitted jobs either of the preemptor's own queue (within-queue
    # preemption: only when the request says how much must come from its own queue, and only jobs of lower priority)
    # or of another queue of the preemptor's cohort (reclaim, borrow_within_cohort)
    cohort_of = {q.name: q.cohort for q in cfg.queues}
    value = {c.name: c.value for c in cfg.priority_classes}
    for r in d.reclaims:
        assert r.need and all(v > 0 for v in r.need.values()) and r.candidates
        preemptor = s.pending[r.preemptor].spec
        for v in r.candidates:
            a = s.admitted[v]
            if a.spec.queue == r.queue:
                assert r.own_need, (r, v)
                assert value[a.spec.priority_class] < value[preemptor.priority_class], (r, v)
            else:
                assert cohort_of[r.queue] is not None and cohort_of[a.spec.queue] == cohort_of[r.queue], (r, v)


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(configs(), st.lists(op, min_size=5, max_size=40))
def test_invariants_hold(cfg: QueuesConfig, ops: list[tuple]) -> None:
    run(cfg, ops)


@settings(max_examples=60, deadline=None)
@given(configs(), st.lists(op, min_size=5, max_size=30))
def test_same_input_same_output(cfg: QueuesConfig, ops: list[tuple]) -> None:
    assert run(cfg, ops) == run(cfg, ops)


@settings(max_examples=60, deadline=None)
@given(configs(), st.lists(op, min_size=5, max_size=30))
def test_copy_is_independent_and_equivalent(cfg: QueuesConfig, ops: list[tuple]) -> None:
    s = AdmissionState(cfg)
    for i, o in enumerate(ops):
        if o[0] == "submit":
            s.submit(Workload(job(f"j{i}", cfg.queues[o[1] % len(cfg.queues)].name, o[2], models=o[4]), i))
    twin = s.copy()
    a, b = admission_cycle(s, 100.0), admission_cycle(twin, 100.0)
    assert (a.admitted, a.pending, a.reclaims) == (b.admitted, b.pending, b.reclaims)
    assert admission_cycle(twin, 101.0).admitted == []  # twin's admissions did not leak into s or back
    for q in cfg.queues:
        assert s.usage(q.name) == twin.usage(q.name)


@settings(max_examples=120, deadline=None)
@given(configs(), st.lists(op, min_size=5, max_size=40))
def test_reusing_unchanged_cohorts_decides_like_a_cycle_from_scratch(cfg: QueuesConfig, ops: list[tuple]) -> None:
    """A cycle reuses the statuses and reclaims of cohorts where nothing changed since they were computed;
    the decision must equal one made with every cache dropped."""
    s = AdmissionState(cfg)
    queues = [q.name for q in cfg.queues]
    said_before: dict = {}
    for i, o in enumerate(ops):
        if o[0] == "submit":
            s.submit(Workload(job(f"j{i}", queues[o[1] % len(queues)], o[2], count=o[3], models=o[4],
                                  priority=o[5]), float(i)))
        elif o[0] in ("finish", "requeue") and s.admitted:
            victim = sorted(s.admitted)[o[1] % len(s.admitted)]
            if o[0] == "finish":
                s.finish(victim)
            else:
                a = s.admitted[victim]
                s.requeue(Workload(a.spec, a.submitted_at))
        elif o[0] == "cycle":
            for _ in range(2):  # the second cycle in a row is where unchanged cohorts are reused
                scratch = s.copy()
                scratch.cycle_memo.reclaims.clear()
                got, want = admission_cycle(s, float(i)), admission_cycle(scratch, float(i))
                assert got.admitted == want.admitted
                assert got.pending == want.pending
                assert got.reclaims == want.reclaims
                # what the service skips (cohorts not judged again) is exactly what an earlier cycle said
                judged = dict(got.pending.judged_items())
                for job_id, st in got.pending.items():
                    if job_id not in judged:
                        assert said_before.get(job_id) == st, job_id
                said_before = dict(got.pending)


@st.composite
def capped_configs(draw: st.DrawFn) -> QueuesConfig:
    """Cohorts of small queues with borrowing limits (so they reach their hard cap and are sealed), beside one
    queue that may borrow without limit (so the cohort's numbers keep moving around them)."""
    queues = []
    for i in range(draw(st.integers(2, 3))):
        quotas: dict[str, Any] = {}
        for m in MODELS:
            if draw(st.booleans()) or (m == H100 and not quotas):
                quotas[m] = quota(draw(st.integers(0, 4)), draw(st.integers(0, 2)))
        queues.append({"name": f"q{i}", "cohort": draw(st.sampled_from(["c1", "c1", "c2"])), "quotas": quotas,
                       "queueing_strategy": draw(st.sampled_from(["StrictFIFO", "BestEffortFIFO"])),
                       "max_running_jobs": draw(st.one_of(st.none(), st.integers(1, 4))),
                       "preemption": {"within_queue": draw(st.sampled_from(["LowerPriority", "Never"])),
                                      "reclaim_within_cohort": draw(st.sampled_from(["Never", "LowerPriority"]))}})
    queues.append({"name": "open", "cohort": "c1", "quotas": {H100: quota(4), A100: quota(2)}})
    return config(*queues, cohorts=("c1", "c2"))


capped_op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 3), st.integers(1, 2), st.integers(1, 2),
              st.sampled_from([(H100,), (A100,), (H100, A100)]), st.sampled_from(["normal", "normal", "low", "high"])),
    st.tuples(st.just("finish"), st.integers(0, 10_000)),
    st.tuples(st.just("cycle")),
)


def _capped(name: str) -> dict[str, Any]:
    return {"name": name, "cohort": "c1", "quotas": {H100: quota(4, 2)}, "max_running_jobs": 1,
            "preemption": {"within_queue": "Never", "reclaim_within_cohort": "Never"}}


# q1's pending job, ahead of q0's in the cohort, is admitted once q1's running job finishes: q0, sealed all along,
# keeps its reasons but its job moves up from 2nd to 1st in the cohort (q1 sealed in the cycle before, so a
# record of only the unsealed queues' lists saw no change and left q0's rows out as settled)
@example(config(_capped("q0"), _capped("q1"), {"name": "open", "cohort": "c1", "quotas": {H100: quota(4)}},
                cohorts=("c1", "c2")),
         [("submit", 0, 1, 1, (H100,), "normal"), ("submit", 1, 1, 1, (H100,), "normal"), ("cycle",),
          ("submit", 1, 1, 1, (H100,), "normal"), ("submit", 0, 1, 1, (H100,), "normal"), ("cycle",),
          ("finish", 1), ("cycle",)])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capped_configs(), st.lists(capped_op, min_size=10, max_size=60))
def test_sealed_queues_keep_the_reasons_a_cycle_from_scratch_gives(cfg: QueuesConfig, ops: list[tuple]) -> None:
    """A queue at its hard cap that nothing changed keeps its jobs' reasons instead of being judged again (its
    cohort changing around it): every decision must equal one made with every cache dropped, messages (with the
    cohort's numbers of now) included; and the rows `judged_rows` leaves out are the earlier cycle's, but for
    the numbers in their messages."""
    s = AdmissionState(cfg)
    queues = [q.name for q in cfg.queues]
    before: dict = {}
    for i, o in enumerate(ops):
        if o[0] == "submit":
            s.submit(Workload(job(f"j{i}", queues[o[1] % len(queues)], o[2], count=o[3], models=o[4],
                                  priority=o[5]), float(i)))
        elif o[0] == "finish" and s.admitted:
            s.finish(sorted(s.admitted)[o[1] % len(s.admitted)])
        elif o[0] == "cycle":
            # the second cycle follows a change elsewhere in cohort c1 (a job for the unlimited queue), the
            # third a change in no queue of it
            for k in range(3):
                if k == 1:
                    s.submit(Workload(job(f"open-{i}", "open", models=(H100, A100)), float(i)))
                scratch = s.copy()
                got, want = admission_cycle(s, float(i)), admission_cycle(scratch, float(i))
                assert got.admitted == want.admitted
                assert got.reclaims == want.reclaims
                assert got.pending == want.pending
                rows = {r[0]: r for r in got.pending.judged_rows()}
                every = {r[0]: r for r in got.pending.judged_rows(settled=True)}
                judged = dict(got.pending.judged_items())
                assert set(rows) <= set(every) == set(judged)
                for job_id, st_ in judged.items():
                    if job_id in rows:
                        _, q, reason, message, qpos, cpos = rows[job_id]
                        assert (q, reason, str(message), qpos, cpos) == (
                            st_.queue, st_.reason, st_.message, st_.position_in_queue, st_.position_in_cohort)
                    else:  # left out: settled, as the earlier cycle said but for the cohort's numbers
                        old = before[job_id]
                        assert (old.reason, old.position_in_queue, old.position_in_cohort) == (
                            st_.reason, st_.position_in_queue, st_.position_in_cohort), job_id
                before = dict(got.pending)


def test_a_queue_sealed_again_between_explaining_cycles_counts_as_moved() -> None:
    """A sealed queue changed and sealed again by a cycle that explains nothing (the simulator's kind) between two
    explaining cycles: its list is not the one the first explaining cycle saw, so the other sealed queue's rows,
    whose positions in the cohort it moved, are not left out as settled."""
    open_queue = {"name": "open", "cohort": "c1", "quotas": {H100: quota(4)}}
    s = AdmissionState(config(_capped("q0"), _capped("q1"), open_queue, cohorts=("c1",)))
    s.submit(Workload(job("r0", "q0"), 0.0))
    s.submit(Workload(job("r1", "q1"), 0.0))
    admission_cycle(s, 1.0)  # both run: each queue is at its max_running_jobs
    s.submit(Workload(job("x", "q1"), 2.0))
    s.submit(Workload(job("a", "q0"), 3.0))
    admission_cycle(s, 4.0)  # judges both and seals them
    s.submit(Workload(job("o1", "open"), 4.5))  # the cohort changed around the sealed queues
    assert admission_cycle(s, 5.0).pending["a"].position_in_cohort == 2  # both sealed all cycle
    s.submit(Workload(job("y", "q1", priority="high"), 6.0))  # ahead of `a` in the cohort
    admission_cycle(s, 7.0, explain=False)  # judges q1 again and seals it again
    s.submit(Workload(job("o2", "open"), 7.5))
    got = admission_cycle(s, 8.0)
    assert got.pending["a"].position_in_cohort == 3
    assert isinstance(got.pending, PendingStatuses)
    rows = {r[0]: r for r in got.pending.judged_rows()}
    assert rows["a"][5] == 3  # not left out as settled at its old position
