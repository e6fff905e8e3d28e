"""The rows admission publishes for `gpuq queues` (summary.py `queue_facts`): after any sequence of submissions,
admissions, ends and requeues, the rows of the queues the state reports touched (with their lending pools'),
merged into the rows written before, equal every row computed afresh: admission rewrites only those, and a queue
it skips has not changed."""

from __future__ import annotations

import random

from services.core.admission import AdmissionState, QueueFacts, Workload, admission_cycle, queue_facts
from tests.unit.admission.admission_core_builders import H100, config, job, queue


def _states() -> AdmissionState:
    # two cohorts (borrowing and lending move a pool's rows together) and a queue in none
    return AdmissionState(config(queue("a", {H100: 4}), queue("b", {H100: 4}), queue("c", {H100: 2}, cohort="other"),
                                 queue("d", {H100: 2}, cohort="other"), queue("solo", {H100: 2}, cohort=None),
                                 cohorts=("research", "other")))


def test_the_touched_queues_rows_bring_every_row_up_to_date() -> None:
    rng = random.Random(7)
    s = _states()
    written: dict[str, QueueFacts] = {f.queue: f for f in queue_facts(s)}
    s.take_touched()
    queues, t, n, lent = ["a", "b", "c", "d", "solo"], 0.0, 0, 0
    for _ in range(400):
        t += 1.0
        op = rng.random()
        if op < 0.45:
            q = rng.choice(queues)
            s.submit(Workload(job(f"j{n}", q, rng.choice((1, 2, 3))), t))  # (a rejection leaves no trace)
            n += 1
        elif op < 0.7:
            admission_cycle(s, t)
        elif op < 0.85 and (s.pending or s.admitted):
            s.finish(rng.choice(sorted({*s.pending, *s.admitted})))
        elif s.admitted:
            held = s.admitted[rng.choice(sorted(s.admitted))]
            s.requeue(Workload(held.spec, held.submitted_at))
        written.update({f.queue: f for f in queue_facts(s, s.take_touched())})
        assert written == {f.queue: f for f in queue_facts(s)}, f"after step at t={t}"
        lent += any(f.lent for f in written.values())
    assert lent > 10  # the walk went through borrowing and lending, not only quiet queues


def test_nothing_touched_nothing_to_redo() -> None:
    s = _states()
    s.take_touched()
    admission_cycle(s, 0.0)
    assert s.take_touched() == set()
    assert queue_facts(s, set()) == []
