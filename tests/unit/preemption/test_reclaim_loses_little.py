"""Issue 49: a reclaim of nominal quota loses little. Its victims are the borrowers that lose the least (the
checkpointing, the recently checkpointed), and when the only borrowers eligible now would throw away a long run
(they cannot checkpoint) while cheaper ones leave their protection window before the lender's deadline, the
reclaim waits for them: the lender still gets its quota within the protection window of its request."""

from __future__ import annotations

from dataclasses import replace

from services.core.pipeline.preempt import choose_victims
from services.core.preemption import RECLAIM, Outcome, select_victims
from shared.domain import CheckpointSpec
from tests.unit.preemption.builders import MODEL, World, queues, spec

NOW = 100_000.0
WINDOW = 600


def borrowed(young_started: float) -> World:
    """team-a (nominal 0) borrows all 16 GPUs: `old`, 8 GPUs, cannot checkpoint, running 10 h; `young`, 8 GPUs,
    checkpoints, started at `young_started` (both with limits far ahead)."""
    w = World(queues(window=WINDOW, a_nominal=0, b_nominal=16, max_loss=1800, loss_aware=True))
    w.run(spec("old", gpus=8, max_runtime_s=7 * 86_400), NOW - 36_000)
    w.run(spec("young", gpus=8, max_runtime_s=7 * 86_400, checkpoint=CheckpointSpec(supported=True, interval_s=1800)),
          young_started)
    return w


def reclaim(w: World, since: float | None, now: float = NOW):  # type: ignore[no-untyped-def]
    p = replace(w.preemptor(spec("lender", queue="team-b", klass="normal", gpus=8), RECLAIM, {MODEL: 8}),
                waiting_since=since)
    return p, select_victims(p, w.running, w.cluster, w.config, now)


def test_a_reclaim_waits_for_a_cheap_borrower_leaving_its_window_before_the_lenders_deadline() -> None:
    w = borrowed(young_started=NOW - 100)
    p, sel = reclaim(w, since=NOW)
    assert sel.victims == () and sel.why == "WaitingForCheaperVictims"
    choice = choose_victims(p, w.running, w.cluster, w.config, NOW, last_preempted=None, recent_victim_times=())
    assert choice.outcome == Outcome.DEFERRED and choice.retry_at == NOW - 100 + WINDOW
    # decided again when the young borrower's window ends: it is the victim, the long run is kept
    _p, sel = reclaim(w, since=NOW, now=NOW - 100 + WINDOW)
    assert sel.victims == ("young",)


def test_the_lender_is_never_kept_past_its_deadline() -> None:
    # the cheap borrower started after the lender asked: its window ends past the lender's deadline, so the
    # reclaim takes the long run now (the guarantee outranks the lost work)
    w = borrowed(young_started=NOW - 100)
    _p, sel = reclaim(w, since=NOW - 200)
    assert sel.victims == ("old",)
    # unknown ask time (a caller that does not say): no waiting, as before
    _p, sel = reclaim(w, since=None)
    assert sel.victims == ("old",)


def test_a_reclaim_takes_the_recently_checkpointed_borrower_over_a_newer_one_that_cannot() -> None:
    # both eligible and within the loss bound: `saved` started earlier but checkpointed a minute ago; `fresh`
    # started 1,000 s ago and cannot checkpoint. The least lost work wins over the most recently started
    w = World(queues(window=WINDOW, a_nominal=0, b_nominal=16, max_loss=1800, loss_aware=True))
    w.run(spec("saved", gpus=8, max_runtime_s=7 * 86_400, checkpoint=CheckpointSpec(supported=True, interval_s=1800)),
          NOW - 20_000, last_checkpoint_at=NOW - 60)
    w.run(spec("fresh", gpus=8, max_runtime_s=7 * 86_400), NOW - 1_000)
    _p, sel = reclaim(w, since=NOW)
    assert sel.victims == ("saved",) and sel.lost_gpu_seconds == 8 * 60
