"""The idle core's clocks as their owner stores them (issue 48): a watch rebuilt from `clock_doc` after a restart
decides what the first one would have, at the same instants; `changed` names each clock that moved once, and versions
only grow across a reload."""

from __future__ import annotations

from services.core.idle import DecisionKind, IdleWatch, RunningJob
from shared.config import parse_queues
from shared.domain import JobKind

CONFIG = parse_queues({"priority_classes": [{"name": "normal", "value": 0}], "queues": [{"name": "q"}],
                       "job_classes": {"notebook": {"idle": {"threshold_pct": 5, "idle_for_s": 600,
                                                             "grace_s": 300}}}})
NB = RunningJob("nb-1", "team-a", JobKind.NOTEBOOK, started_at=0.0, user="alice", can_checkpoint=True)


def reloaded(watch: IdleWatch) -> IdleWatch:
    again = IdleWatch(CONFIG)
    for job_id in ("nb-1",):
        doc = watch.clock_doc(job_id)
        assert doc is not None
        again.load_clock(job_id, doc)
    return again


def test_a_reloaded_watch_warns_and_reclaims_when_the_first_would_have() -> None:
    watch = IdleWatch(CONFIG)
    for t in range(60, 481, 60):
        watch.sample(NB, "n1/0", t, 1.0)
    assert watch.due([NB], 480) == []
    assert watch.changed() == ["nb-1"] and watch.changed() == []
    watch = reloaded(watch)
    for t in range(540, 661, 60):
        watch.sample(NB, "n1/0", t, 1.0)
    [warn] = watch.due([NB], 660)  # idle since 60: 600 s, across the reload
    assert warn.kind is DecisionKind.WARN and warn.deadline == 960
    before = watch.clock_doc("nb-1")
    assert before is not None and before["warned_at"] == 660
    watch = reloaded(watch)
    watch.sample(NB, "n1/0", 720, 1.0)
    assert watch.clock_doc("nb-1")["version"] > before["version"]  # type: ignore[index]
    for t in range(780, 961, 60):
        watch.sample(NB, "n1/0", t, 1.0)
    assert watch.due([NB], 959) == []  # warned once, not again after the reload
    [reclaim] = watch.due([NB], 960)
    assert reclaim.kind is DecisionKind.RECLAIM


def test_a_clock_that_goes_is_named_with_nothing_to_store() -> None:
    watch = IdleWatch(CONFIG)
    watch.sample(NB, "n1/0", 60, 1.0)
    watch.changed()
    assert watch.due([], 120) == []  # no longer running
    assert watch.changed() == ["nb-1"] and watch.clock_doc("nb-1") is None
