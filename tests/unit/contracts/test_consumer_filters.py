"""What a consumer filters on (shared/bus.py `ConsumerPlan`): exactly the handled subjects where the server takes
several filters (NATS >= 2.10), the stream's pattern on 2.9; and the subscriptions never overlap, which NATS
requires of a consumer's filters (error 10136)."""

from __future__ import annotations

from itertools import combinations

from shared.bus import consumer_plan, streams, takes_filter_subjects
from shared.events import BY_TYPE, JobCompleted, JobPlaced, JobSubmitted, NodeInventory
from shared.namespace import subject as ns_subject


def test_filter_subjects_from_nats_2_10_on() -> None:
    assert not takes_filter_subjects(2, 9)
    assert not takes_filter_subjects(0, 0)  # a version the connection could not tell: the single filter
    assert takes_filter_subjects(2, 10) and takes_filter_subjects(2, 15) and takes_filter_subjects(3, 0)


def test_a_consumer_filters_on_its_subjects_or_on_the_pattern() -> None:
    plans = {plan.suffix: plan for plan in consumer_plan([JobSubmitted, JobCompleted, NodeInventory])}
    assert sorted(plans) == ["job", "node"]
    job, node = plans["job"], plans["node"]
    assert job.subjects == (ns_subject("job.completed"), ns_subject("job.submitted.*"))  # sorted, team wildcard
    assert job.filters(multi_filter=True) == job.subjects
    assert job.filters(multi_filter=False) == (ns_subject("job.>"),)
    assert node.filters(multi_filter=True) == node.filters(multi_filter=False) == (NodeInventory.subscription(),)
    assert consumer_plan([JobPlaced])[0].filters(multi_filter=False) == (JobPlaced.subscription(),)


def _overlap(a: str, b: str) -> bool:
    """Could one subject match both subscriptions? (They use `*` only: one token each.)"""
    ta, tb = a.split("."), b.split(".")
    return len(ta) == len(tb) and all(x == y or "*" in (x, y) for x, y in zip(ta, tb, strict=True))


def test_no_two_subscriptions_of_a_stream_pattern_overlap() -> None:
    subscriptions = sorted({cls.subscription() for cls in BY_TYPE.values()})
    assert not any(">" in s for s in subscriptions)
    plans = {plan.pattern: plan.subjects for plan in consumer_plan(BY_TYPE.values())}
    assert set(plans) <= {pattern for stream in streams() for pattern in stream.subjects}
    for subjects in plans.values():
        assert [(a, b) for a, b in combinations(subjects, 2) if _overlap(a, b)] == []
