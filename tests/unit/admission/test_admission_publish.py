"""Which pending-status changes become JobPending events (services/admission/publish.py)."""

from services.admission.publish import MESSAGE_EVERY_S, Published, worth_publishing


def last(reason: str = "WaitingForQuota", message: str = "uses 8/8", q: int = 500, c: int = 900,
         at: float = 100.0) -> Published:
    return Published(reason, message, q, c, at)


def test_first_status_and_reason_changes_are_always_published() -> None:
    assert worth_publishing(None, "WaitingForQuota", "m", 500, 900, 0.0)
    assert worth_publishing(last(), "WaitingForReclaim", "uses 8/8", 500, 900, 100.5)


def test_small_moves_deep_in_the_queue_are_not_news_but_large_ones_are() -> None:
    assert not worth_publishing(last(), "WaitingForQuota", "uses 8/8", 499, 899, 101.0)
    assert not worth_publishing(last(), "WaitingForQuota", "uses 8/8", 460, 900, 101.0)  # 40 < 10% of 500
    assert worth_publishing(last(), "WaitingForQuota", "uses 8/8", 450, 900, 101.0)  # 50 = 10% of 500
    assert worth_publishing(last(), "WaitingForQuota", "uses 8/8", 500, 800, 101.0)  # cohort moved 100


def test_every_move_near_the_head_is_published() -> None:
    near = last(q=12, c=12)
    assert worth_publishing(near, "WaitingForQuota", "uses 8/8", 10, 10, 101.0)  # into the first ten
    assert worth_publishing(last(q=3, c=3), "WaitingForQuota", "uses 8/8", 2, 2, 101.0)
    assert not worth_publishing(near, "WaitingForQuota", "uses 8/8", 12, 12, 101.0)  # nothing moved


def test_new_numbers_in_the_message_wait_for_the_quiet_period() -> None:
    assert not worth_publishing(last(), "WaitingForQuota", "uses 7/8", 500, 900, 100.0 + MESSAGE_EVERY_S - 1)
    assert worth_publishing(last(), "WaitingForQuota", "uses 7/8", 500, 900, 100.0 + MESSAGE_EVERY_S)
    assert not worth_publishing(last(), "WaitingForQuota", "uses 8/8", 500, 900, 10_000.0)  # nothing changed
