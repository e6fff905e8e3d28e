import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.metering.segments import Fact, FactKind, build_segments
from services.metering.testing import ms

SHARES = (("n1", 8000), ("n2", 8000))


def placed(s, shares=SHARES, hint="H100-80GB"):
    return Fact(FactKind.PLACED, ms(s), shares, hint)


def end(kind, s, lost_s=0.0):
    return Fact(kind, ms(s), lost_ms=round(lost_s * 1000))


def test_placement_to_completion_per_node():
    parts = build_segments([placed(0), Fact(FactKind.STARTED, ms(30)), end(FactKind.COMPLETED, 3600)])
    assert [(p.node, p.milli_gpus, p.placed_at_ms, p.ended_at_ms, p.end_kind) for p in parts] == [
        ("n1", 8000, ms(0), ms(3600), "completed"), ("n2", 8000, ms(0), ms(3600), "completed")]
    assert all(p.started_at_ms == ms(30) for p in parts)


def test_preempted_then_resumed_elsewhere_then_completed():
    facts = [placed(0), end(FactKind.PREEMPTED, 1800, lost_s=300.0), placed(2400, (("n3", 8000),)),
             end(FactKind.COMPLETED, 6000)]
    parts = build_segments(facts)
    assert [(p.node, p.placed_at_ms, p.ended_at_ms, p.end_kind, p.lost_ms) for p in parts] == [
        ("n1", ms(0), ms(1800), "preempted", 150_000), ("n2", ms(0), ms(1800), "preempted", 150_000),
        ("n3", ms(2400), ms(6000), "completed", 0)]


def test_an_allocation_without_an_end_stays_open():
    parts = build_segments([placed(0), Fact(FactKind.STARTED, ms(5))])
    assert [(p.ended_at_ms, p.end_kind) for p in parts] == [(None, None), (None, None)]


def test_a_placement_after_the_jobs_cancel_ends_at_once():
    """A cancel stamped before the placement (admission decided it while the scheduler placed the job) is the job's
    end: the placement is closed at its own instant, never left open (tests/unit/metering/test_metering_orderings.py
    has every ordering)."""
    parts = build_segments([end(FactKind.CANCELLED, -60), placed(0)])
    assert [(p.ended_at_ms, p.end_kind) for p in parts] == [(ms(0), "cancelled"), (ms(0), "cancelled")]


def test_missing_end_is_closed_by_the_next_placement():
    parts = build_segments([placed(0, (("n1", 1000),)), placed(100, (("n2", 1000),))])
    assert [(p.node, p.ended_at_ms, p.end_kind) for p in parts] == [("n1", ms(100), "replaced"), ("n2", None, None)]


def resized(s, shares):
    return Fact(FactKind.RESIZED, ms(s), shares, "H100-80GB")


def test_a_grown_elastic_job_is_charged_its_pods_from_the_resize_on():
    """Issue 48: an elastic job grown from 2 to 4 GPUs at 600 s is charged 2 GPUs before and 4 after, one run: the
    segment before ends "resized", the next starts at the resize (its job had started), no gap, no overlap."""
    facts = [placed(0, (("n1", 2000),)), Fact(FactKind.STARTED, ms(10)),
             resized(600, (("n1", 2000), ("n2", 2000))), end(FactKind.COMPLETED, 3600)]
    parts = build_segments(facts)
    assert [(p.node, p.milli_gpus, p.placed_at_ms, p.started_at_ms, p.ended_at_ms, p.end_kind) for p in parts] == [
        ("n1", 2000, ms(0), ms(10), ms(600), "resized"),
        ("n1", 2000, ms(600), ms(600), ms(3600), "completed"),
        ("n2", 2000, ms(600), ms(600), ms(3600), "completed")]
    gpu_ms = sum(p.milli_gpus * (p.ended_at_ms - p.placed_at_ms) for p in parts if p.ended_at_ms is not None) // 1000
    assert gpu_ms == 2 * 600_000 + 4 * 3_000_000  # GPU-milliseconds


def test_a_shrink_then_a_preemption_charges_the_shrunk_size_and_its_lost_work():
    facts = [placed(0, (("n1", 4000),)), Fact(FactKind.STARTED, ms(5)), resized(100, (("n1", 1000),)),
             end(FactKind.PREEMPTED, 200, lost_s=10.0)]
    parts = build_segments(facts)
    assert [(p.milli_gpus, p.ended_at_ms, p.end_kind, p.lost_ms) for p in parts] == [
        (4000, ms(100), "resized", 0), (1000, ms(200), "preempted", 10_000)]


def test_a_resize_before_the_start_is_started_when_the_job_starts():
    parts = build_segments([placed(0, (("n1", 1000),)), resized(60, (("n1", 2000),)), Fact(FactKind.STARTED, ms(90))])
    assert [(p.milli_gpus, p.started_at_ms, p.ended_at_ms, p.end_kind) for p in parts] == [
        (1000, None, ms(60), "resized"), (2000, ms(90), None, None)]


def test_same_instant_ends_prefer_the_preemption():
    parts = build_segments([placed(0, (("n1", 1000),)), end(FactKind.COMPLETED, 50), end(FactKind.PREEMPTED, 50, 7)])
    assert (parts[0].end_kind, parts[0].lost_ms) == ("preempted", 7000)


def test_end_at_the_instant_of_the_next_placement_ends_only_the_earlier_one():
    parts = build_segments([placed(0, (("n1", 1000),)), end(FactKind.PREEMPTED, 100, 5), placed(100, (("n2", 1000),)),
                            end(FactKind.COMPLETED, 200)])
    assert [(p.node, p.ended_at_ms, p.end_kind, p.lost_ms) for p in parts] == [
        ("n1", ms(100), "preempted", 5000), ("n2", ms(200), "completed", 0)]


def test_preemption_without_known_placement_keeps_its_lost_work():
    parts = build_segments([end(FactKind.PREEMPTED, 500, lost_s=42.5)])
    assert [(p.node, p.milli_gpus, p.lost_ms, p.end_kind) for p in parts] == [("", 0, 42_500, "preempted")]


def test_no_facts_no_parts():
    assert build_segments([]) == []


_fact = st.one_of(
    st.builds(lambda s, n: Fact(FactKind.RESIZED, ms(s), ((f"n{n}", 4000),), None),
              st.integers(0, 20) .map(lambda x: x * 300 + 100), st.integers(0, 3)),
    st.builds(lambda s, n: Fact(FactKind.PLACED, ms(s), ((f"n{n}", 8000),), None),
              st.integers(0, 20) .map(lambda x: x * 300), st.integers(0, 3)),
    st.builds(lambda k, s, lost: Fact(k, ms(s), lost_ms=lost if k is FactKind.PREEMPTED else 0),
              st.sampled_from([k for k in FactKind if k not in (FactKind.PLACED, FactKind.RESIZED)]),
              st.integers(0, 40).map(lambda x: x * 150 + (x % 3 == 0) * 7),
              st.integers(0, 10**6)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_fact, max_size=12), st.randoms(use_true_random=False))
def test_segments_depend_only_on_the_set_of_facts(facts, rnd):
    """Redelivered (duplicated) and reordered facts give exactly the same allocation parts."""
    shuffled = facts + facts[: len(facts) // 2]
    rnd.shuffle(shuffled)
    assert build_segments(shuffled) == build_segments(facts)


@settings(max_examples=200, deadline=None)
@given(st.lists(_fact, max_size=12))
def test_segments_never_overlap_and_lost_work_is_conserved(facts):
    parts = build_segments(facts)
    spans = sorted({(p.placed_at_ms, p.ended_at_ms) for p in parts if p.node})
    for (a0, a1), (b0, _) in itertools.pairwise(spans):
        assert a1 is not None and a1 <= b0
        assert a0 <= a1
    preempted_at: dict[int, int] = {}
    for f in facts:  # one fact per instant; the smallest lost_ms wins a disagreement
        if f.kind is FactKind.PREEMPTED:
            preempted_at[f.at_ms] = min(f.lost_ms, preempted_at.get(f.at_ms, f.lost_ms))
    assert sum(p.lost_ms for p in parts) == sum(preempted_at.values())
