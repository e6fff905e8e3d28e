"""The victim rules, one situation each."""

from __future__ import annotations

import pytest

import services.core.preemption.policy as policy_module
from services.core.preemption import (
    PRIORITY,
    RECLAIM,
    Preemptor,
    Why,
    protection,
    protection_ends,
    select_victims,
    usage_by_queue,
    victim_verdict,
)
from shared.config import parse_queues
from shared.domain import JobKind
from tests.unit.preemption.builders import MODEL, World, queues, spec

NOW = 100_000.0


def verdict(world: World, preemptor_spec, victim, reason: str = "PriorityPreemption", need=None) -> str | None:  # type: ignore[no-untyped-def]
    p = world.preemptor(preemptor_spec, reason, need)
    return victim_verdict(p, victim, world.config, usage_by_queue(world.running), NOW)


def test_only_strictly_lower_priority_and_preemptible_classes() -> None:
    w = World(queues())
    low = w.run(spec("low", klass="low"), NOW - 5000)
    normal = w.run(spec("normal", klass="normal"), NOW - 5000)
    high = w.run(spec("high", klass="high"), NOW - 5000)
    boss = spec("boss", klass="normal", gpus=1)
    assert verdict(w, boss, low) is None
    assert verdict(w, boss, normal) == Why.NOT_LOWER_PRIORITY
    assert verdict(w, spec("prod", klass="production"), high) == Why.NOT_PREEMPTIBLE


def test_production_is_never_preempted_even_when_the_spec_says_preemptible() -> None:
    w = World(queues())
    prod = w.run(spec("p", klass="production", preemptible=True), NOW - 5000)
    assert prod.production and not prod.preemptible
    assert verdict(w, spec("x", klass="production"), prod) == Why.PRODUCTION


def test_spec_override_makes_a_low_job_unpreemptible() -> None:
    w = World(queues())
    pinned = w.run(spec("pinned", klass="low", preemptible=False), NOW - 5000)
    assert verdict(w, spec("boss", klass="high"), pinned) == Why.NOT_PREEMPTIBLE


def test_training_never_preempts_inference() -> None:
    w = World(queues())
    serving = w.run(spec("serve", klass="low", kind=JobKind.INFERENCE), NOW - 5000)
    assert verdict(w, spec("train", klass="high"), serving) == Why.INFERENCE
    assert verdict(w, spec("infer", klass="high", kind=JobKind.INFERENCE), serving) is None


def test_protection_window_just_started_and_near_end() -> None:
    w = World(queues(window=600))
    young = w.run(spec("young"), NOW - 100)
    # a job 5 minutes from its expected end is left alone
    ending = w.run(spec("ending", max_runtime_s=3600), NOW - 3600 + 300)
    middle = w.run(spec("middle", max_runtime_s=3600), NOW - 1800)
    boss = spec("boss", klass="high")
    assert verdict(w, boss, young) == Why.JUST_STARTED
    assert verdict(w, boss, ending) == Why.NEAR_END
    assert verdict(w, boss, middle) is None
    assert protection(young, NOW, 600) == (Why.JUST_STARTED, NOW - 100 + 600)


def test_other_queue_only_while_it_borrows_and_reclaim_never_takes_own_queue() -> None:
    w = World(queues(a_nominal=4, b_nominal=12))
    a1 = w.run(spec("a1", queue="team-a", gpus=4), NOW - 5000)
    a2 = w.run(spec("a2", queue="team-a", gpus=4), NOW - 5000)  # team-a now uses 8 > nominal 4: borrowing
    b1 = w.run(spec("b1", queue="team-b", gpus=2), NOW - 5000)
    boss_b = spec("boss", queue="team-b", klass="high", gpus=8)
    assert verdict(w, boss_b, a1, RECLAIM, {MODEL: 8}) is None
    assert verdict(w, boss_b, b1, RECLAIM, {MODEL: 8}) == Why.RECLAIM_SAME_QUEUE
    boss_a = spec("boss-a", queue="team-a", klass="high")
    assert verdict(w, boss_a, b1) == Why.NOT_BORROWING  # team-b within nominal: its guarantee holds
    assert verdict(w, boss_a, a2) is None  # own queue, lower priority


def test_queue_policies_never_and_any() -> None:
    never = queues(a_nominal=4, preemption={"within_queue": "Never", "reclaim_within_cohort": "Never"})
    w = World(never)
    a1 = w.run(spec("a1", queue="team-a", gpus=8), NOW - 5000)
    assert verdict(w, spec("x", queue="team-a", klass="high"), a1) == Why.WITHIN_QUEUE_NEVER
    assert verdict(w, spec("y", queue="team-b", klass="high"), a1) == Why.RECLAIM_NEVER
    anyq = queues(a_nominal=4, preemption={"within_queue": "LowerPriority", "reclaim_within_cohort": "Any"})
    w2 = World(anyq)
    a_normal = w2.run(spec("a-normal", queue="team-a", gpus=8, klass="normal"), NOW - 5000)
    # Any: a borrower is reclaimed whatever its priority (equal here)
    assert verdict(w2, spec("b", queue="team-b", klass="normal"), a_normal, RECLAIM, {MODEL: 1}) is None


def test_reclaim_takes_borrowers_first_and_only_what_is_needed() -> None:
    w = World(queues(a_nominal=4, b_nominal=12))
    w.run(spec("a-old", queue="team-a", gpus=4), NOW - 9000)
    w.run(spec("a-new", queue="team-a", gpus=4), NOW - 2000)
    w.run(spec("a-mid", queue="team-a", gpus=4), NOW - 4000)
    w.run(spec("a-rest", queue="team-a", gpus=4), NOW - 8000)
    boss = spec("b-boss", queue="team-b", klass="normal", gpus=4, pods=2)  # any two 4-GPU holes will do
    sel = select_victims(w.preemptor(boss, RECLAIM, {MODEL: 8}), w.running, w.cluster, w.config, NOW)
    # least lost work: the two most recent jobs (team-a keeps its 8 >= nominal 4)
    assert sel.victims == ("a-new", "a-mid")
    assert sel.lost_gpu_seconds == 4 * 2000 + 4 * 4000


def test_reclaim_never_takes_a_borrower_far_below_its_nominal() -> None:
    w = World(queues(a_nominal=12, b_nominal=4))
    for i in range(4):
        w.run(spec(f"a{i}", queue="team-a", gpus=4), NOW - 5000 - i)  # 16 used, nominal 12: borrows 4
    boss = spec("b-boss", queue="team-b", klass="normal", gpus=8)
    sel = select_victims(w.preemptor(boss, RECLAIM, {MODEL: 8}), w.running, w.cluster, w.config, NOW)
    assert sel.victims == ()  # one victim frees only 4, a second would take team-a below its guarantee


def test_placement_decides_which_set_is_sufficient() -> None:
    w = World(queues(a_nominal=4, b_nominal=12))
    w.run(spec("a-old", queue="team-a", gpus=4), NOW - 9000)  # n-0 with a-new
    w.run(spec("a-new", queue="team-a", gpus=4), NOW - 2000)
    w.run(spec("a-mid", queue="team-a", gpus=4), NOW - 4000)  # n-1 with a-rest
    w.run(spec("a-rest", queue="team-a", gpus=4), NOW - 8000)
    boss = spec("b-boss", queue="team-b", klass="normal", gpus=8)  # one pod: needs a whole node
    sel = select_victims(w.preemptor(boss, RECLAIM, {MODEL: 8}), w.running, w.cluster, w.config, NOW)
    assert sorted(sel.victims) == ["a-new", "a-old"]  # 44,000 GPU-s lost beats n-1's 48,000


def test_checkpoint_reduces_lost_work_and_drives_the_choice() -> None:
    w = World(queues())
    w.run(spec("fresh-ckpt", gpus=8), NOW - 7000, last_checkpoint_at=NOW - 60)
    w.run(spec("no-ckpt", gpus=8), NOW - 3000)
    sel = select_victims(w.preemptor(spec("boss", klass="high", gpus=8)), w.running, w.cluster, w.config, NOW)
    assert sel.victims == ("fresh-ckpt",)
    assert sel.lost_gpu_seconds == 8 * 60


def test_a_gang_is_preempted_whole() -> None:
    w = World(queues())
    w.run(spec("gang", gpus=4, pods=2), NOW - 5000)  # 2 pods x 4 GPUs, on one or two nodes
    w.run(spec("other", gpus=8), NOW - 5000, last_checkpoint_at=NOW - 10)
    sel = select_victims(w.preemptor(spec("boss", klass="high", gpus=8, pods=2)), w.running, w.cluster,
                         w.config, NOW)
    assert sorted(sel.victims) == ["gang", "other"]


def test_nothing_is_taken_when_the_preemptor_fits_or_nothing_suffices() -> None:
    w = World(queues())
    w.run(spec("small", gpus=2), NOW - 5000)
    sel = select_victims(w.preemptor(spec("boss", klass="high", gpus=4)), w.running, w.cluster, w.config, NOW)
    assert sel.victims == () and sel.why == "FitsWithoutPreemption"
    w.run(spec("protected", gpus=8), NOW - 10)
    w.run(spec("big", gpus=6), NOW - 5000)
    sel = select_victims(w.preemptor(spec("boss2", klass="high", gpus=16)), w.running, w.cluster, w.config, NOW)
    assert sel.victims == () and sel.why == "InsufficientVictims"
    assert sel.rejected["protected"] == Why.JUST_STARTED


def test_a_job_that_would_lose_more_than_the_bound_is_left_alone() -> None:
    """max_victim_loss_s: unsaved work since the last checkpoint (or since start) caps who may be taken."""
    w = World(queues(max_loss=1800))
    fresh_ckpt = w.run(spec("saved-recently"), NOW - 20_000, last_checkpoint_at=NOW - 600)
    never_saved = w.run(spec("never-saved"), NOW - 20_000)
    young = w.run(spec("young"), NOW - 1_200)
    boss = spec("boss", klass="normal")
    assert verdict(w, boss, fresh_ckpt) is None
    assert verdict(w, boss, never_saved) == Why.TOO_MUCH_LOST_WORK
    assert verdict(w, boss, young) is None  # 20 minutes of work at risk: under the 30-minute bound
    unbounded = World(queues(max_loss=None))
    assert verdict(unbounded, boss, unbounded.run(spec("never-saved"), NOW - 20_000)) is None


def test_the_unsaved_work_bound_never_vetoes_a_reclaim_of_nominal_quota() -> None:
    """B's nominal quota comes back even when the only borrower cannot checkpoint and ran for hours."""
    w = World(queues(max_loss=1800, a_nominal=8, b_nominal=8))
    w.run(spec("a-own", queue="team-a", gpus=8), NOW - 20_000)
    never_saved = w.run(spec("a-borrower", queue="team-a", gpus=8), NOW - 20_000)
    owner = spec("b-owner", queue="team-b", klass="normal", gpus=8)
    assert verdict(w, owner, never_saved) == Why.TOO_MUCH_LOST_WORK  # a priority preemption still respects it
    assert verdict(w, owner, never_saved, RECLAIM, {MODEL: 8}) is None
    sel = select_victims(w.preemptor(owner, RECLAIM, {MODEL: 8}), w.running, w.cluster, w.config, NOW)
    assert len(sel.victims) == 1 and sel.lost_gpu_seconds == 8 * 20_000


def test_the_unsaved_work_bound_steers_a_reclaim_to_borrowers_within_it() -> None:
    def victims(max_loss: int | None) -> tuple[str, ...]:
        w = World(queues(max_loss=max_loss, a_nominal=4, b_nominal=12))
        w.run(spec("a-within", queue="team-a", gpus=8), NOW - 1_700)  # 13,600 GPU-s, 1,700 s each
        w.run(spec("a-over", queue="team-a", gpus=4), NOW - 1_900)  # 7,600 GPU-s, but 1,900 s each
        owner = spec("b-owner", queue="team-b", klass="normal", gpus=4)
        return select_victims(w.preemptor(owner, RECLAIM, {MODEL: 4}), w.running, w.cluster, w.config,
                              NOW).victims
    assert victims(None) == ("a-over",)  # least lost GPU-seconds
    assert victims(1800) == ("a-within",)  # nobody loses more than the bound when someone else can give


def test_within_queue_request_takes_the_queues_own_lower_priority_job_even_with_free_gpus() -> None:
    """Admission's within-queue preemption is about quota: team-a is at its nominal 8 while GPUs are free."""
    w = World(queues(a_nominal=8, b_nominal=8))
    w.run(spec("a-low-old", queue="team-a", gpus=4), NOW - 9000)
    w.run(spec("a-low-new", queue="team-a", gpus=4), NOW - 2000)
    boss = spec("a-boss", queue="team-a", klass="normal", gpus=4)
    p = Preemptor(job_id="a-boss", queue="team-a", priority=100, kind=boss.kind, spec=boss, reason=PRIORITY,
                  need={MODEL: 4}, own_need={MODEL: 4})
    sel = select_victims(p, w.running, w.cluster, w.config, NOW)
    assert sel.victims == ("a-low-new",)  # least lost work
    assert select_victims(w.preemptor(boss), w.running, w.cluster, w.config, NOW).why == "FitsWithoutPreemption"


def test_preempt_in_the_queue_and_reclaim_in_one_decision() -> None:
    w = World(queues(a_nominal=8, b_nominal=8))
    w.run(spec("a-low", queue="team-a", gpus=4), NOW - 2000)  # team-a: 4 of 8
    for i in range(3):
        w.run(spec(f"b{i}", queue="team-b", gpus=4), NOW - 5000 - i)  # team-b: 12 of 8, borrows 4
    boss = spec("a-boss", queue="team-a", klass="normal", gpus=8)
    p = Preemptor(job_id="a-boss", queue="team-a", priority=100, kind=boss.kind, spec=boss, reason=RECLAIM,
                  need={MODEL: 8}, own_need={MODEL: 4})
    sel = select_victims(p, w.running, w.cluster, w.config, NOW)
    assert "a-low" in sel.victims and len(sel.victims) == 2
    # a plain reclaim never takes from the reclaiming queue itself
    plain = Preemptor(job_id="a-boss", queue="team-a", priority=100, kind=boss.kind, spec=boss, reason=RECLAIM,
                      need={MODEL: 8})
    assert select_victims(plain, w.running, w.cluster, w.config, NOW).rejected["a-low"] == Why.RECLAIM_SAME_QUEUE


def test_borrow_within_cohort_takes_no_borrower_above_its_threshold() -> None:
    w = World(queues(a_nominal=4, b_nominal=4))
    low = w.run(spec("a-low", queue="team-a", gpus=4), NOW - 5000)
    normal = w.run(spec("a-normal", queue="team-a", klass="normal", gpus=4), NOW - 5000)
    boss = spec("b-boss", queue="team-b", klass="high", gpus=8)
    p = Preemptor(job_id="b-boss", queue="team-b", priority=500, kind=boss.kind, spec=boss, reason=RECLAIM,
                  need={MODEL: 4}, max_victim_priority=0)
    usage = usage_by_queue(w.running)
    assert victim_verdict(p, low, w.config, usage, NOW) is None
    assert victim_verdict(p, normal, w.config, usage, NOW) == Why.NOT_LOWER_PRIORITY


def test_protection_ends_is_the_earliest_end_among_candidates_rejected_as_just_started() -> None:
    w = World(queues(window=600))
    young = w.run(spec("young", gpus=8), NOW - 100)
    younger = w.run(spec("younger", gpus=8), NOW - 50)
    rejected = {"young": Why.JUST_STARTED, "younger": Why.JUST_STARTED}
    assert protection_ends(w.running, rejected, NOW, 600) == young.started_at + 600
    # a job rejected for another reason (here: near its end) does not set a retry time
    assert protection_ends(w.running, {"younger": Why.NEAR_END}, NOW, 600) is None
    assert protection_ends(w.running, {"younger": Why.JUST_STARTED}, NOW, 600) == younger.started_at + 600
    assert protection_ends(w.running, {}, NOW, 600) is None


def _tree_world() -> World:
    """team-a and team-b in sibling child cohorts of one root; team-c in a tree of its own."""
    data = queues(a_nominal=4, b_nominal=12).model_dump(mode="json")
    data["cohorts"] = [{"name": "org"}, {"name": "vision", "parent": "org"}, {"name": "speech", "parent": "org"},
                       {"name": "other"}]
    data["queues"][0]["cohort"], data["queues"][1]["cohort"] = "vision", "speech"
    data["queues"].append({**data["queues"][1], "name": "team-c", "cohort": "other"})
    return World(parse_queues(data))


def test_a_reclaim_takes_a_borrower_of_another_child_cohort_of_the_same_tree_only() -> None:
    w = _tree_world()
    a1 = w.run(spec("a1", queue="team-a", gpus=8), NOW - 5000)  # team-a uses 8 > nominal 4: borrows via org
    lender = spec("lender", queue="team-b", klass="high", gpus=8)
    assert verdict(w, lender, a1, RECLAIM, {MODEL: 8}) is None
    stranger = spec("stranger", queue="team-c", klass="high", gpus=8)
    assert verdict(w, stranger, a1, RECLAIM, {MODEL: 8}) == Why.OTHER_COHORT


def test_the_unsaved_work_bound_holds_for_a_preemptor_that_borrows() -> None:
    """borrow_within_cohort and fair-sharing requests (max_victim_priority set) reclaim no guarantee: a borrower
    that would lose hours of unsaved work is left alone, as for a priority preemption."""
    w = World(queues(max_loss=1800, a_nominal=4, b_nominal=4))
    never_saved = w.run(spec("a-borrower", queue="team-a", gpus=8), NOW - 20_000)
    borrower = spec("b-borrower", queue="team-b", klass="normal", gpus=8)
    p = Preemptor(job_id="b-borrower", queue="team-b", priority=100, kind=borrower.kind, spec=borrower,
                  reason=RECLAIM, need={MODEL: 4}, max_victim_priority=100)
    assert victim_verdict(p, never_saved, w.config, usage_by_queue(w.running), NOW) == Why.TOO_MUCH_LOST_WORK


def test_selection_asks_whether_a_queue_borrows_once_per_queue_with_the_same_verdicts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Judging every running job asked "does its queue borrow?" once per job; the answer depends only on the
    # queue (the preemptor and the usage are fixed for one selection), so it is now asked once per queue.
    w = World(queues(a_nominal=4, b_nominal=12), node_count=4)
    for i in range(6):
        w.run(spec(f"a{i}", queue="team-a", gpus=4), NOW - 2000 - i)
    w.run(spec("b0", queue="team-b", gpus=4), NOW - 3000)
    boss = w.preemptor(spec("b-boss", queue="team-b", klass="normal", gpus=4), RECLAIM, {MODEL: 4})
    usage = usage_by_queue(w.running)
    alone = [victim_verdict(boss, j, w.config, usage, NOW) for j in w.running]
    memo: dict[str, bool] = {}
    shared = [victim_verdict(boss, j, w.config, usage, NOW, memo) for j in w.running]
    assert shared == alone and memo == {"team-a": True}
    asked: list[str] = []
    real = policy_module.is_borrowing

    def counted(queue: str, *args: object) -> bool:
        asked.append(queue)
        return real(queue, *args)  # type: ignore[arg-type]  # the arguments is_borrowing was given

    monkeypatch.setattr(policy_module, "is_borrowing", counted)
    sel = select_victims(boss, w.running, w.cluster, w.config, NOW)
    assert sel.victims == ("a0",)  # the most recent borrower: least lost work
    assert asked == ["team-a"]
