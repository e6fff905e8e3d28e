"""`gpuq reconcile-bus`: what it publishes again after a restore, and the --since it refuses, saying why."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from cli.restore import ReconcileError, check_since, kind_of, parse_since
from shared import namespace as namespaces

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
DAY_S = 86_400.0


def test_what_is_published_again_and_what_is_left_out() -> None:
    ns = namespaces.current()
    restored = {"decided-before"}
    assert kind_of(f"{ns}.job.completed", "decided-before", restored) == "restored decision"
    assert kind_of(f"{ns}.job.completed", "decided-after", restored) is None  # only the lost database's
    assert kind_of(f"{ns}.job.placed", "decided-after", restored) is None
    assert kind_of(f"{ns}.utilization.sampled", "decided-after", restored) is None
    for subject in ("job.submitted.team-a", "job.cancel_requested.team-a", "job.approved", "queue.config_changed",
                    "utilization.flops_reported.team-a"):
        assert kind_of(f"{ns}.{subject}", "asked-after", restored) == "request", subject
    assert kind_of(f"{ns}.audit.recorded.scheduler", "decided-after", restored) == "audit record"
    assert kind_of("other-platform.job.submitted.team-a", "x", restored) is None  # another namespace's


def test_a_time_with_its_zone_is_taken() -> None:
    assert parse_since("2026-12-05T08:00:00Z") == datetime(2026, 12, 5, 8, 0, tzinfo=UTC)
    assert parse_since("2026-12-05T09:00:00+01:00") == datetime(2026, 12, 5, 8, 0, tzinfo=UTC)


@pytest.mark.parametrize(("text", "why"), [("2026-12-05T08:00:00", "no time zone"),
                                           ("yesterday", "not an ISO 8601 time")])
def test_a_time_without_a_zone_or_not_a_time_is_refused(text: str, why: str) -> None:
    with pytest.raises(ReconcileError, match=why):
        parse_since(text)


def test_a_future_since_is_refused() -> None:
    with pytest.raises(ReconcileError, match="in the future"):
        check_since(NOW + timedelta(hours=1), NOW, None, 7 * DAY_S)


def test_a_since_after_the_backup_or_before_what_the_inboxes_remember_is_refused() -> None:
    handled = NOW - timedelta(days=2)  # the backup's moment, as the restored inboxes tell it
    check_since(handled - timedelta(minutes=10), NOW, handled, 7 * DAY_S)
    check_since(handled - timedelta(days=7), NOW, handled, 7 * DAY_S)
    with pytest.raises(ReconcileError, match="would be left out"):
        check_since(handled + timedelta(minutes=1), NOW, handled, 7 * DAY_S)
    with pytest.raises(ReconcileError, match="would be handled twice"):
        check_since(handled - timedelta(days=7, seconds=1), NOW, handled, 7 * DAY_S)
    check_since(NOW - timedelta(days=30), NOW, None, 7 * DAY_S)  # a database no service ran on: nothing to check
