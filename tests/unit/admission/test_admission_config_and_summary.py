"""Config changes keep every job; per-queue summaries for `gpuq queues`."""

from __future__ import annotations

from services.core.admission import AdmissionState, Reason, Workload, admission_cycle, queue_summaries
from tests.unit.admission.admission_core_builders import A100, H100, config, job, queue, quota, submit, submit_many


def test_admitted_jobs_stay_admitted_when_quota_shrinks() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 8}, cohort=None)))
    submit_many(s, "team-a", 3, 2)
    admission_cycle(s, 0.0)
    messages = s.set_config(config(queue("team-a", {H100: 2}, cohort=None)))
    assert len(s.admitted) == 3 and s.usage("team-a") == {H100: 6}
    assert any("team-a now holds 6 H100-80GB, above the 2" in m for m in messages)
    submit(s, job("new", "team-a", 1), 5)
    d = admission_cycle(s, 6.0)
    assert not d.admitted and d.pending["new"].reason == Reason.WAITING_FOR_QUOTA
    for j in ("team-a-0", "team-a-1"):
        s.finish(j)
    assert admission_cycle(s, 7.0).admitted == []  # 2 still held = the new nominal
    s.finish("team-a-2")
    assert [a.job_id for a in admission_cycle(s, 8.0).admitted] == ["new"]


def test_pending_jobs_of_a_deleted_queue_become_inadmissible_and_come_back() -> None:
    before = config(queue("team-a", {H100: 2}), queue("team-b", {H100: 2}))
    s = AdmissionState(before)
    submit_many(s, "team-b", 4, 1)
    admission_cycle(s, 0.0)  # 2 own + 2 borrowed from team-a
    submit(s, job("b-wait", "team-b", 1), 2)
    messages = s.set_config(config(queue("team-a", {H100: 2})))
    assert "pending job b-wait is now inadmissible (InadmissibleQueueDeleted): queue 'team-b' no longer exists; " \
           "the job waits until it is configured again" in messages
    assert any("admitted job team-b-0 stays admitted" in m for m in messages)
    d = admission_cycle(s, 3.0)
    assert d.pending["b-wait"].reason == Reason.QUEUE_DELETED
    assert s.inadmissible("b-wait") is not None
    assert len(s.admitted) == 4
    messages = s.set_config(before)
    assert "pending job b-wait is admissible again" in messages


def test_config_change_rejudges_pending_flavors() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 0, A100: 4}, cohort=None)))
    r = s.submit(Workload(job("h", "team-a", 1, models=(H100,)), 0))  # nominal 0, no cohort: never fits
    assert r is not None and r.reason == Reason.EXCEEDS_LIMITS and "h" not in s.pending
    submit(s, job("a", "team-a", 1, models=(A100,)), 0)
    s.set_config(config(queue("team-a", {H100: 4}, cohort=None)))
    d = admission_cycle(s, 1.0)
    assert d.pending["a"].reason == Reason.NO_FLAVOR


def test_summary_counts_used_borrowed_lent_pending_and_oldest_wait() -> None:
    s = AdmissionState(config(
        queue("team-a", {H100: 8}, weight=2),
        queue("team-b", {H100: quota(4, lending_limit=2)}),
        queue("team-c", {H100: 6}),
        queue("other", {A100: 4}, cohort=None, max_running_jobs=3),
    ))
    submit_many(s, "team-a", 7, 2)  # 14 = 8 own + 6 borrowed from b (lends at most 2) and c (lends 6)
    admission_cycle(s, 10.0)
    submit(s, job("c0", "team-c", 4), 20)
    submit(s, job("o0", "other", 1, models=(A100,)), 25)
    rows = {r.queue: r for r in queue_summaries(s, 30.0)}
    assert list(rows) == ["other", "team-a", "team-b", "team-c"]
    a, b, c = rows["team-a"], rows["team-b"], rows["team-c"]
    assert (a.nominal, a.used, a.borrowed, a.running, a.pending, a.weight) == (
        {H100: 8}, {H100: 14}, {H100: 6}, 7, 0, 2)
    assert a.oldest_wait_s is None
    # 6 borrowed, attributed to lenders by unused lendable quota: b 2, c 6 -> 6 * 2/8 and 6 * 6/8
    # 6 * 2/8 = 1.5 and 6 * 6/8 = 4.5: equal remainders, the extra unit goes by name
    assert (b.lent, c.lent) == ({H100: 2}, {H100: 4})
    assert c.pending == 1 and c.oldest_wait_s == 10.0
    assert rows["other"].max_running_jobs == 3 and rows["other"].strategy == "BestEffortFIFO"


def test_summary_lent_is_proportional_with_integer_remainders() -> None:
    s = AdmissionState(config(queue("team-a", {H100: 0}), queue("l1", {H100: 3}), queue("l2", {H100: 3})))
    submit_many(s, "team-a", 5, 1)
    admission_cycle(s, 0.0)
    rows = {r.queue: r for r in queue_summaries(s, 0.0)}
    assert (rows["l1"].lent, rows["l2"].lent) == ({H100: 3}, {H100: 2})  # 2.5 each; remainder by name
