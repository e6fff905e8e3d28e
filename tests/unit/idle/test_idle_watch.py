"""The idle-reclaim core (services/core/idle): warn after `idle_for_s` below the threshold, reclaim `grace_s` after the
warning, a busy sample resets, no data is not idleness, the TTL ends a job, and a new run starts a new clock."""

from __future__ import annotations

import pytest

from services.core.idle import DecisionKind, IdleWatch, RunningJob
from shared.config import parse_queues
from shared.domain import JobKind
from shared.interactive import IdleAction

BASE = {"priority_classes": [{"name": "normal", "value": 0}], "queues": [{"name": "q"}]}


def config(job_classes: dict | None = None):  # type: ignore[no-untyped-def]
    return parse_queues({**BASE, **({"job_classes": job_classes} if job_classes is not None else {})})


NB = RunningJob("nb-1", "team-a", JobKind.NOTEBOOK, started_at=0.0, user="alice", can_checkpoint=True)


def feed(watch: IdleWatch, job: RunningJob, start: float, end: float, util: float, gpus: int = 1) -> None:
    t = start
    while t <= end:
        for g in range(gpus):
            watch.sample(job, f"n1/{g}", t, util)
        t += 60


def test_notebook_defaults_warn_after_30_idle_minutes_then_reclaim_after_the_grace() -> None:
    watch = IdleWatch(config())
    feed(watch, NB, 60, 1800, 1.0)
    assert watch.due([NB], 1799) == []  # idle since 60: 1739 s
    feed(watch, NB, 1860, 1860, 1.0)
    [warn] = watch.due([NB], 1860)
    assert warn.kind is DecisionKind.WARN and warn.user == "alice" and warn.deadline == 1860 + 900
    assert watch.due([NB], 1900) == []  # warned once
    feed(watch, NB, 1920, 2760, 1.0)
    assert watch.due([NB], 2759) == []  # grace counts from the warning
    [reclaim] = watch.due([NB], 2760)
    assert reclaim.kind is DecisionKind.RECLAIM and reclaim.action is IdleAction.REQUEUE and reclaim.checkpoint
    assert watch.due([NB], 3000) == []  # once


def test_a_busy_gpu_resets_the_clock_and_withdraws_the_warning() -> None:
    watch = IdleWatch(config())
    feed(watch, NB, 60, 1860, 1.0, gpus=2)
    assert [d.kind for d in watch.due([NB], 1860)] == [DecisionKind.WARN]
    watch.sample(NB, "n1/1", 1900, 50.0)  # one of its GPUs is used: the job is not idle
    feed(watch, NB, 1920, 2800, 1.0, gpus=1)  # n1/0 idle, n1/1's latest sample still busy
    assert watch.due([NB], 2800) == []
    feed(watch, NB, 2820, 2820, 1.0, gpus=2)  # now both idle again: a new clock from 2820
    assert watch.due([NB], 2820 + 1799) == []


def test_no_recent_sample_is_not_idleness() -> None:
    watch = IdleWatch(config())
    feed(watch, NB, 60, 1860, 0.0)
    assert watch.due([NB], 1860 + 301) == []  # the exporter went quiet: nothing is decided


def test_ttl_ends_the_job_whatever_its_use() -> None:
    watch = IdleWatch(config({"notebook": {"ttl_s": 3600}}))
    feed(watch, NB, 60, 3600, 90.0)
    [ttl] = watch.due([NB], 3600)
    assert ttl.kind is DecisionKind.TTL and ttl.reason == "TtlExpired" and ttl.action is IdleAction.END
    assert watch.due([NB], 3700) == []


def test_training_has_no_idle_reclaim_unless_configured() -> None:
    job = RunningJob("t-1", "team-a", JobKind.TRAINING, started_at=0.0)
    watch = IdleWatch(config())
    feed(watch, job, 60, 10_000, 0.0)
    assert watch.due([job], 10_000) == []
    watch = IdleWatch(config({"training": {"idle": {"threshold_pct": 10, "idle_for_s": 600, "grace_s": 0,
                                                    "action": "end"}}}))
    feed(watch, job, 60, 660, 5.0)
    [warn] = watch.due([job], 660)  # no grace: warned, and reclaimed at the next look
    assert warn.kind is DecisionKind.WARN and warn.deadline == 660
    [reclaim] = watch.due([job], 661)
    assert reclaim.kind is DecisionKind.RECLAIM and reclaim.action is IdleAction.END and not reclaim.checkpoint


def test_a_requeued_job_running_again_starts_a_new_clock() -> None:
    watch = IdleWatch(config({"notebook": {"idle": {"idle_for_s": 600, "grace_s": 0}}}))
    feed(watch, NB, 60, 660, 0.0)
    assert [d.kind for d in watch.due([NB], 660)] == [DecisionKind.WARN]
    assert [d.kind for d in watch.due([NB], 660)] == [DecisionKind.RECLAIM]
    again = RunningJob(NB.job_id, NB.team, NB.kind, started_at=5000.0, user=NB.user)
    feed(watch, again, 5060, 5600, 0.0)
    assert watch.due([again], 5600) == []  # idle since 5060: 540 s
    feed(watch, again, 5660, 5660, 0.0)
    assert [d.kind for d in watch.due([again], 5660)] == [DecisionKind.WARN]


def test_invalid_idle_settings_are_refused_with_their_path() -> None:
    with pytest.raises(Exception, match=r"job_classes.notebook.idle.threshold_pct"):
        config({"notebook": {"idle": {"threshold_pct": 0}}})
    with pytest.raises(Exception, match=r"job_classes.notebook.idle.action"):
        config({"notebook": {"idle": {"action": "delete"}}})
