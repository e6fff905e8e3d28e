"""Every placement is charged until its end, whatever the order of the events (issue 43 item 6).

A cancel can land just before a placement: admission stamps JobCancelled while the scheduler, not having heard it
yet, places the job, so the placement's instant is *after* the cancel's. The ledger kept such a placement open for
ever (8 GPUs charged indefinitely to a team, 4 of 60 placed jobs at normal speed). Here: each ordering on its own,
then a property over whole lifecycles (placements, preemptions, retried attempts, the job's end, a cancel anywhere
from the previous attempt's end to after the placement) delivered in any order, duplicated."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.metering.segments import Fact, FactKind, build_segments
from services.metering.testing import ms


def placed(s: float, node: str = "n1") -> Fact:
    return Fact(FactKind.PLACED, ms(s), ((node, 8000),), "H100-80GB")


def started(s: float) -> Fact:
    return Fact(FactKind.STARTED, ms(s))


def cancelled(s: float) -> Fact:
    return Fact(FactKind.CANCELLED, ms(s))


def spans(facts: list[Fact]) -> list[tuple[int, int | None, str | None]]:
    """(placed, ended, end kind) per placement, in seconds from T0."""
    seen = sorted({(p.placed_at_ms, p.ended_at_ms, p.end_kind) for p in build_segments(facts) if p.node})
    return [(round((a - ms(0)) / 1000), None if b is None else round((b - ms(0)) / 1000), k) for a, b, k in seen]


# ----------------------------------------------------------------------------- each ordering


def test_cancel_stamped_just_before_the_placement_closes_it_at_once() -> None:
    """JobCancelled then JobPlaced, in stamps and in arrival: the placement is of a job already over."""
    assert spans([cancelled(10.0), placed(10.2)]) == [(10, 10, "cancelled")]
    assert spans([placed(10.2), cancelled(10.0)]) == [(10, 10, "cancelled")]  # arrival order does not matter


def test_cancel_after_the_placement_before_the_start_ends_it_at_the_cancel() -> None:
    assert spans([placed(0), cancelled(30)]) == [(0, 30, "cancelled")]
    # the executor had the placement before the cancel and started it after the cancel's instant
    assert spans([placed(0), cancelled(30), started(31)]) == [(0, 30, "cancelled")]


def test_a_redelivered_placement_after_the_cancel_changes_nothing() -> None:
    facts = [placed(0), started(1), cancelled(30)]
    assert spans([*facts, placed(0), cancelled(30)]) == spans(facts) == [(0, 30, "cancelled")]


def test_a_cancel_racing_the_re_placement_after_a_preemption() -> None:
    """Preempted, requeued, cancelled while pending; the scheduler re-placed it before it heard the cancel."""
    facts = [placed(0), Fact(FactKind.PREEMPTED, ms(100)), cancelled(150), placed(151, "n2")]
    assert spans(facts) == [(0, 100, "preempted"), (151, 151, "cancelled")]
    # the preemption's fact arriving last (another stream, a slow consumer) leaves the same ledger
    assert spans(facts[::-1]) == spans(facts)


def test_a_retried_attempt_does_not_end_the_job_but_a_final_failure_does() -> None:
    attempt = Fact(FactKind.FAILED, ms(100), retried=True)
    assert spans([placed(0), attempt, placed(150, "n2")]) == [(0, 100, "failed"), (150, None, None)]
    final = Fact(FactKind.FAILED, ms(100))
    assert spans([placed(0), final, placed(150, "n2")]) == [(0, 100, "failed"), (150, 150, "failed")]


def test_a_completion_stamped_before_a_late_placement_closes_it() -> None:
    """Any end of the job, not only a cancel: nothing after the job's end will ever end a placement."""
    assert spans([Fact(FactKind.COMPLETED, ms(5)), placed(6)]) == [(6, 6, "completed")]


def test_an_end_after_the_late_placement_still_counts() -> None:
    """Placed after the cancel but then run to its end by an executor that had not heard the cancel: the job's
    later end is what frees the GPUs."""
    assert spans([cancelled(5), placed(6), started(7), Fact(FactKind.COMPLETED, ms(60))]) == [(6, 60, "completed")]


def test_a_cancel_before_any_placement_charges_nothing() -> None:
    assert build_segments([cancelled(5)]) == []


# ----------------------------------------------------------------------------- whole lifecycles, any order


@dataclass(frozen=True)
class Lifecycle:
    facts: tuple[Fact, ...]
    expected: tuple[tuple[int, int | None], ...]  # per placement: (placed_ms, charged until ms, or None: still held)
    ended: bool  # the job's own end is among the facts


@st.composite
def lifecycles(draw: st.DrawFn) -> Lifecycle:
    """A job's attempts as the platform stamps them: each placement ends by a preemption or a retried failure, the
    last one by completion, final failure, a cancel or not yet. A cancel is stamped anywhere from the previous
    attempt's end (the job pending again) to after the placement: before it is the race (the scheduler placed a job
    admission had just cancelled), charged nothing; after it, charged until the cancel."""
    facts: list[Fact] = []
    expected: list[tuple[int, int | None]] = []
    t = 0
    attempts = draw(st.integers(0, 3))
    for i in range(attempts):
        prev_end = t
        at = t + draw(st.integers(0, 50))  # 0: placed again at the instant the last attempt ended
        dur = draw(st.integers(1, 100))
        facts.append(Fact(FactKind.PLACED, ms(at), ((f"n{i % 2}", 8000),), None))
        if draw(st.booleans()):  # the executor's start, anywhere while the placement holds (even after a cancel)
            facts.append(Fact(FactKind.STARTED, ms(at + draw(st.integers(0, dur)))))
        last = i == attempts - 1
        outcome = draw(st.sampled_from(["preempted", "retried"] if not last else
                                       ["completed", "failed", "cancelled", "running"]))
        end = at + dur
        if outcome == "preempted":
            facts.append(Fact(FactKind.PREEMPTED, ms(end), lost_ms=draw(st.integers(0, 5000))))
        elif outcome in ("retried", "failed"):
            facts.append(Fact(FactKind.FAILED, ms(end), retried=outcome == "retried"))
        elif outcome == "completed":
            facts.append(Fact(FactKind.COMPLETED, ms(end)))
        elif outcome == "cancelled":
            cancel_at = draw(st.integers(prev_end, end))
            facts.append(Fact(FactKind.CANCELLED, ms(cancel_at)))
            end = max(at, cancel_at)
        expected.append((ms(at), None if outcome == "running" else ms(end)))
        t = end if outcome != "running" else t
    ended = bool(facts) and facts[-1].ends_job
    if attempts == 0 and draw(st.booleans()):  # cancelled while waiting, never placed
        facts.append(Fact(FactKind.CANCELLED, ms(draw(st.integers(0, 50)))))
        ended = True
    return Lifecycle(tuple(facts), tuple(expected), ended)


@settings(max_examples=400, deadline=None)
@given(lifecycles(), st.randoms(use_true_random=False))
def test_every_placement_is_charged_until_its_end_whatever_the_arrival_order(life: Lifecycle,
                                                                            rnd: random.Random) -> None:
    delivered = [*life.facts, *rnd.sample(life.facts, k=len(life.facts) // 2)]  # some redelivered
    rnd.shuffle(delivered)
    parts = [p for p in build_segments(delivered) if p.node]
    charged = sorted({(p.placed_at_ms, p.ended_at_ms) for p in parts})
    assert charged == sorted(life.expected)
    if life.ended:
        assert all(p.ended_at_ms is not None for p in parts), "the job ended but a placement is still charged"
    # each prefix of the deliveries (the ledger after each arrival) never charges a placement past its end
    for k in range(len(delivered) + 1):
        for p in build_segments(delivered[:k]):
            if p.node and p.ended_at_ms is not None:
                assert p.ended_at_ms >= p.placed_at_ms


_any_fact = st.one_of(
    st.builds(lambda s, n: Fact(FactKind.PLACED, ms(s), ((f"n{n}", 8000),), None), st.integers(0, 60),
              st.integers(0, 2)),
    st.builds(lambda k, s, r: Fact(k, ms(s), retried=r and k is FactKind.FAILED),
              st.sampled_from([k for k in FactKind if k is not FactKind.PLACED]), st.integers(0, 60), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_any_fact, max_size=10))
def test_once_the_job_has_ended_nothing_is_charged_open_ended(facts: list[Fact]) -> None:
    """Any set of facts, however unlikely its stamps: if one says the job is over, no allocation stays open, and none
    ends before it began."""
    parts = build_segments(facts)
    for p in parts:
        assert p.ended_at_ms is None or p.ended_at_ms >= p.placed_at_ms
    if any(f.ends_job for f in facts):
        assert all(p.ended_at_ms is not None for p in parts)
