"""Refusing a queue's run of alike borrowers in one loop (cycle.py `_refuse_alike`) decides exactly what refusing
them one by one through the heap decides (`_Cycle.batch_refusals = False`, the reference): the same admissions,
the same reclaims, every pending job's reason and message, cycle after cycle, over random cohorts where reclaims
hold cohort room while deep queues of borrowers wait."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.core.admission import AdmissionState, Workload, admission_cycle
from services.core.admission import cycle as cycle_module
from services.core.admission.lending import covered
from shared.config import QueuesConfig
from shared.domain import CheckpointSpec
from tests.unit.admission.admission_core_builders import A100, H100, config, job, quota, submit


def _decide(s: AdmissionState, now: float, batched: bool, **kw: Any) -> tuple:
    """One cycle with batching on or off; what it decided, messages included."""
    saved = cycle_module._Cycle.batch_refusals
    cycle_module._Cycle.batch_refusals = batched
    try:
        d = admission_cycle(s, now, **kw)
    finally:
        cycle_module._Cycle.batch_refusals = saved
    return ([a.job_id for a in d.admitted], d.admitted,
            sorted((j, status.reason, status.message, status.position_in_queue, status.position_in_cohort)
                   for j, status in d.pending.items()), d.reclaims)


@pytest.fixture
def batched_jobs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many jobs `_refuse_alike` refused, cycle after cycle (so a test knows the batch ran)."""
    counts: list[int] = []
    refuse = cycle_module._Cycle._refuse_alike

    def counted(self: Any, q: str, *args: Any) -> None:
        before = len(self.refused[q])
        refuse(self, q, *args)
        counts.append(len(self.refused[q]) - before)

    monkeypatch.setattr(cycle_module._Cycle, "_refuse_alike", counted)
    return counts


def _held_cohort(policy: dict[str, Any] | None = None, checkpoints: bool = False) -> AdmissionState:
    """b1 borrows 6 of the cohort's GPUs; the lender's high-priority job asks them back, and the reclaim holds the
    2 left free: every borrower of b1 and b2 after it is refused for that held room."""
    cfg = config({"name": "lender", "cohort": "research", "quotas": {H100: quota(4)}},
                 {"name": "b1", "cohort": "research", "quotas": {H100: quota(2)}},
                 {"name": "b2", "cohort": "research", "quotas": {H100: quota(2)}},
                 {"name": "spare", "cohort": "research", "quotas": {H100: quota(4)}}, policy=policy)
    s = AdmissionState(cfg)
    kw: dict[str, Any] = {"checkpoint": CheckpointSpec(supported=True)} if checkpoints else {}
    for i in range(10):
        q = "b1" if i < 8 else "b2"
        submit(s, job(f"{q}-old-{i}", q).model_copy(update=kw), float(i))
    admission_cycle(s, 1.0)
    submit(s, job("L", "lender", 4, priority="high"), 2.0)
    for i in range(5):
        submit(s, job(f"b1-{i}", "b1").model_copy(update=kw), 3.0 + i)
        submit(s, job(f"b2-{i}", "b2").model_copy(update=kw), 3.0 + i)
    submit(s, job("b2-two", "b2", 2), 9.0)  # another request: its own message, after the batch stops at it
    return s


def test_a_run_of_borrowers_held_out_is_refused_in_one_loop_as_one_by_one(batched_jobs: list[int]) -> None:
    s = _held_cohort()
    reference = s.copy()
    got, want = _decide(s, 10.0, True), _decide(reference, 10.0, False)
    assert got == want
    assert sum(batched_jobs) == 8  # b1-1..4 and b2-1..4 (each queue's first refusal is the unbatched one's)
    held = "the 2 H100-80GB left in cohort research are held for the jobs preempting or reclaiming this cycle (L)"
    reasons = {j: (reason, message) for j, reason, message, _qp, _cp in got[2]}
    assert reasons["b2-4"] == ("WaitingForBorrowableQuota", f"needs to borrow 1 H100-80GB; {held}")
    assert reasons["b2-two"] == ("WaitingForBorrowableQuota", f"needs to borrow 2 H100-80GB; {held}")


def test_a_run_stops_where_another_queues_head_sorts_first(batched_jobs: list[int]) -> None:
    """b1's low-priority borrowers sort after b2's (b2's share is lower): the unbatched loop refuses b2-low-0 between
    b1-4 and b1-low-0, so b1's run stops at b1-4 and its low jobs are refused from b1-low-0 on, a run of their own.
    (Here no decision depends on it; where that job is admitted instead, the room it takes changes the rest.)"""
    s = _held_cohort()
    for i in range(3):
        submit(s, job(f"b1-low-{i}", "b1", priority="low"), 10.0 + i)
        submit(s, job(f"b2-low-{i}", "b2", priority="low"), 10.0 + i)
    reference = s.copy()
    assert _decide(s, 20.0, True) == _decide(reference, 20.0, False)
    # b2-1..4; none after b2-two (another request); b1-1..4; b2-low-1..2; b1-low-1..2
    assert batched_jobs == [4, 0, 4, 2, 2]


def test_a_borrower_lending_refuses_ends_the_run_with_its_own_message(batched_jobs: list[int]) -> None:
    """Under loss_aware_reclaim, a borrower that cannot checkpoint (the same request, so the same fit) is refused by
    lending, not for the held room: the run stops before it and it keeps lending's message."""
    s = _held_cohort({"loss_aware_reclaim": True}, checkpoints=True)
    submit(s, job("b1-long", "b1"), 8.5)  # no checkpoint, a day's limit: a reclaim would throw its run away
    reference = s.copy()
    got = _decide(s, 10.0, True)
    assert got == _decide(reference, 10.0, False)
    assert sum(batched_jobs) == 8
    reasons = {j: message for j, _reason, message, _qp, _cp in got[2]}
    assert "held for the jobs preempting" in reasons["b1-4"]
    assert "without throwing away its run" in reasons["b1-long"]


@st.composite
def held_cohorts(draw: st.DrawFn) -> tuple[QueuesConfig, list[tuple], list[tuple]]:
    """A cohort whose borrowers leave `free` GPUs unused, a lender's job that needs more (its reclaim holds them),
    then deep queues of borrowers in groups of alike jobs (size, models, priority, checkpointing), and cycles with
    finishes between. Returns the config, the running jobs (queue, count), and the ops after them."""
    free = draw(st.integers(1, 3))
    lender = free + draw(st.integers(1, 3))
    queues: list[dict[str, Any]] = [{
        "name": "lender", "cohort": "c1", "quotas": {H100: quota(lender), A100: quota(draw(st.integers(0, 2)))},
        "preemption": {"within_queue": "LowerPriority",
                       "reclaim_within_cohort": draw(st.sampled_from(["LowerPriority", "LowerPriority", "Any"]))}}]
    borrowers = draw(st.integers(2, 4))
    for i in range(borrowers):
        quotas: dict[str, Any] = {H100: quota(draw(st.integers(0, 2)))}
        if draw(st.booleans()):
            quotas[A100] = quota(draw(st.integers(0, 2)))
        queues.append({"name": f"b{i}", "cohort": "c1", "quotas": quotas, "weight": draw(st.sampled_from([1, 1, 2])),
                       "queueing_strategy": draw(st.sampled_from(["BestEffortFIFO"] * 4 + ["StrictFIFO"])),
                       "preemption": {"within_queue": draw(st.sampled_from(["LowerPriority", "Never"])),
                                      "reclaim_within_cohort": "LowerPriority"}})
    spare = draw(st.integers(0, 2))
    queues.append({"name": "spare", "cohort": "c1", "quotas": {H100: quota(spare)}})
    policy = {"loss_aware_reclaim": draw(st.sampled_from([False, False, True]))}
    cfg = config(*queues, cohorts=("c1",), policy=policy)
    total = lender + spare + sum(q["quotas"][H100]["nominal"] for q in queues[1:-1])
    # the running borrowers: total - free GPUs of 1-GPU jobs, spread over the borrowers
    shares = draw(st.lists(st.integers(0, 3), min_size=borrowers, max_size=borrowers).filter(any))
    counts = [(total - free) * w // sum(shares) for w in shares]
    counts[shares.index(max(shares))] += total - free - sum(counts)
    running = [(f"b{i}", c) for i, c in enumerate(counts) if c]
    groups = st.tuples(st.just("submit"), st.integers(0, borrowers - 1), st.sampled_from([1, 1, 1, 2, 3]),
                       st.integers(1, 6),  # how many alike jobs at once
                       st.sampled_from([(H100,), (H100,), (H100,), (A100,), (H100, A100), (A100, H100)]),
                       st.sampled_from(["low", "normal", "normal", "high"]), st.sampled_from([True, True, False]))
    lend = st.tuples(st.just("lend"), st.integers(1, lender), st.sampled_from(["high", "production"]))
    ops = draw(st.lists(st.one_of(groups, groups, groups, lend, st.tuples(st.just("finish"), st.integers(0, 99)),
                                  st.tuples(st.just("cycle"), st.sampled_from([None, None, None, 3]))),
                        min_size=3, max_size=25))
    return cfg, running, [("lend", lender, "high"), *ops, ("cycle", None)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(held_cohorts())
def test_batched_refusals_decide_like_one_by_one(case: tuple[QueuesConfig, list[tuple], list[tuple]]) -> None:
    cfg, running, ops = case
    s = AdmissionState(cfg)
    for q, count in running:
        for k in range(count):
            submit(s, job(f"{q}-run-{k}", q), 0.0)
    assert len(admission_cycle(s, 0.0).admitted) == sum(c for _q, c in running)
    n = 0
    for i, o in enumerate(ops, start=1):
        now = float(i)
        if o[0] == "submit":
            _, b, gpus, alike, models, priority, checkpoints = o
            spec = job("alike", f"b{b}", gpus, models=models, priority=priority)
            for _k in range(alike):
                s.submit(Workload(spec.model_copy(update={"job_id": f"j{n}", "checkpoint": CheckpointSpec(
                    supported=checkpoints)}), now))  # a rejection (a non-preemptible job too big) is fine
                n += 1
        elif o[0] == "lend":
            s.submit(Workload(job(f"j{n}", "lender", o[1], priority=o[2]), now))
            n += 1
        elif o[0] == "finish" and s.admitted:
            s.finish(sorted(s.admitted)[o[1] % len(s.admitted)])
        elif o[0] == "cycle":
            reference = s.copy()
            assert _decide(s, now, True, max_admissions=o[1]) == _decide(reference, now, False, max_admissions=o[1])


def _covered_by_the_old_loop(admitted: dict[str, Any], candidates: tuple[str, ...], need: dict[str, int]) -> bool:
    """`LendingGuard.hold_if_coverable`'s loop before `covered`: what is left of the need, candidate by candidate."""
    left = {r: n for r, n in need.items() if n > 0}
    for c in candidates:
        if not left:
            break
        usage = admitted[c].usage
        for r in sorted(left):
            left[r] -= usage.get(r, 0)
            if left[r] <= 0:
                del left[r]
    return not left


@settings(max_examples=300, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from([H100, A100, "cpu"]), st.integers(0, 4), max_size=3), max_size=6),
       st.dictionaries(st.sampled_from([H100, A100, "cpu"]), st.integers(-1, 9), max_size=3))
def test_coverage_of_a_hold_reads_like_the_loop_it_replaced(usages: list[dict[str, int]], need: dict[str, int]) -> None:
    admitted = {f"c{i}": SimpleNamespace(usage=u) for i, u in enumerate(usages)}
    candidates = tuple(admitted)
    assert covered(admitted, candidates, need) == _covered_by_the_old_loop(admitted, candidates, need)  # type: ignore[arg-type]
