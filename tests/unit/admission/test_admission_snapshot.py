"""AdmissionState.copy as the ETA loop's snapshot: the worker thread reads the copy while the service's handlers go
on changing the live state, so nothing either side changes may show on the other."""

from __future__ import annotations

from services.core.admission import AdmissionState, Workload, admission_cycle
from tests.unit.admission.admission_core_builders import H100, config, job, queue, submit, submit_many


def _state() -> AdmissionState:
    s = AdmissionState(config(queue("a", {H100: 4}), queue("b", {H100: 4}), queue("solo", {H100: 2}, cohort=None)))
    submit_many(s, "a", 6)
    submit_many(s, "b", 3, gpus=2)
    submit_many(s, "solo", 2)
    admission_cycle(s, 10.0)
    submit(s, job("late-a", "a", priority="high"), 11.0)
    # a requeued job: its queue's list holds its old entry and its new one until the list is re-filtered
    waiting = s.pending["a-5"]
    s.requeue(Workload(waiting.spec, waiting.submitted_at))
    victim = sorted(s.admitted)[0]
    held = s.admitted[victim]
    s.requeue(Workload(held.spec, held.submitted_at))
    return s


def _seen(s: AdmissionState) -> tuple[object, ...]:
    """Everything of a state the ETA's forward simulation reads, and what it would decide next."""
    lists = {q: [(e.job_id, e.order, e.admitted is not None) for e in lst]
             for q, lst in s.ordered_pending(None).items()}
    queues = [q.name for q in s.config.queues]
    book = ({q: s.usage(q) for q in queues}, {q: s.running(q) for q in queues}, {q: s.borrowed(q) for q in queues},
            {q: s.available(q, H100) for q in queues})
    return (dict(s.pending), dict(s.admitted), lists, book, {j: s.priority(j) for j in s.pending})


def _decided(s: AdmissionState, now: float) -> tuple[object, ...]:
    d = admission_cycle(s.copy(), now, explain=False)
    return (tuple(a.job_id for a in d.admitted), tuple(r.preemptor for r in d.reclaims))


def test_mutating_the_live_state_after_the_snapshot_leaves_the_snapshot_unchanged() -> None:
    live = _state()
    snap = live.copy()
    before, decided = _seen(snap), _decided(snap, 20.0)
    # What the handlers do while the worker thread reads: submissions (a new shape too), ends, a requeue, cycles.
    submit_many(live, "a", 3, prefix="more-a")
    submit(live, job("wide", "b", 2, count=2), 12.0)
    for job_id in sorted(live.admitted)[:3]:
        live.finish(job_id)
    moved = sorted(live.admitted)[0]
    live.requeue(Workload(live.admitted[moved].spec, live.admitted[moved].submitted_at))
    admission_cycle(live, 13.0)
    admission_cycle(live, 14.0)
    assert _seen(snap) == before
    assert _decided(snap, 20.0) == decided


def test_the_snapshot_side_changes_nothing_of_the_live_state() -> None:
    live = _state()
    before, shapes = _seen(live), dict(live._sig_ids)
    snap = live.copy()
    admission_cycle(snap, 20.0)
    for job_id in sorted(snap.admitted):
        snap.finish(job_id)
    submit(snap, job("only-in-snap", "a", 3, count=1), 21.0)
    admission_cycle(snap, 22.0)
    assert _seen(live) == before
    assert live._sig_ids == shapes  # the interned shapes are the live state's own (a dict the handlers add to)


def test_a_requeued_job_appears_once_in_the_snapshot() -> None:
    live = _state()
    snap = live.copy()
    listed = [e.job_id for lst in snap.ordered_pending(None).values() for e in lst]
    assert len(listed) == len(set(listed)) == len(live.pending)
    assert set(listed) == set(live.pending)
