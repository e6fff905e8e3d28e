"""`gpuq replay-requests` refuses a --since that would publish what must not be published again, saying why."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from cli.restore import ReplayError, check_since, parse_since

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
DAY_S = 86_400.0


def test_a_time_with_its_zone_is_taken() -> None:
    assert parse_since("2026-12-05T08:00:00Z") == datetime(2026, 12, 5, 8, 0, tzinfo=UTC)
    assert parse_since("2026-12-05T09:00:00+01:00") == datetime(2026, 12, 5, 8, 0, tzinfo=UTC)


@pytest.mark.parametrize(("text", "why"), [("2026-12-05T08:00:00", "no time zone"),
                                           ("yesterday", "not an ISO 8601 time")])
def test_a_time_without_a_zone_or_not_a_time_is_refused(text: str, why: str) -> None:
    with pytest.raises(ReplayError, match=why):
        parse_since(text)


def test_a_future_since_is_refused() -> None:
    with pytest.raises(ReplayError, match="in the future"):
        check_since(NOW + timedelta(hours=1), NOW, None, 7 * DAY_S)


def test_a_since_before_what_the_restored_inboxes_remember_is_refused() -> None:
    handled = NOW - timedelta(days=2)  # the backup's moment, as the restored inboxes tell it
    check_since(handled - timedelta(minutes=10), NOW, handled, 7 * DAY_S)
    check_since(handled - timedelta(days=7), NOW, handled, 7 * DAY_S)
    with pytest.raises(ReplayError, match="would be handled twice"):
        check_since(handled - timedelta(days=7, seconds=1), NOW, handled, 7 * DAY_S)
    check_since(NOW - timedelta(days=30), NOW, None, 7 * DAY_S)  # no database given: not checked
