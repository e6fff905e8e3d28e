import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.metering.rollup import (
    AllocationRow,
    Granularity,
    JobDims,
    UsageRow,
    build_cells,
    grand_total,
    rollup,
    split_hours,
    team_summary_table,
)
from services.core.metering.units import HOUR_MS
from services.metering.testing import T0_MS, ms

H = 3600
DIMS = {
    "a1": JobDims("a1", "team-a", "team-a", "normal", "training", labels=(("feature", "search"),)),
    "b1": JobDims("b1", "team-b", "team-b", "high", "training", labels=(("feature", "ads"), ("project", "p9"))),
}


def test_split_hours_covers_the_interval():
    assert split_hours(ms(1800), ms(2 * H + 60)) == [
        (T0_MS, 1_800_000), (T0_MS + HOUR_MS, HOUR_MS), (T0_MS + 2 * HOUR_MS, 60_000)]
    assert split_hours(ms(5), ms(5)) == []


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10 * 24 * 3600 * 1000), st.integers(0, 3 * 24 * 3600 * 1000))
def test_split_hours_sums_to_the_duration(start, length):
    parts = split_hours(start, start + length)
    assert sum(p for _, p in parts) == length
    assert all(h % HOUR_MS == 0 and 0 < p <= HOUR_MS for h, p in parts)


def test_allocated_used_idle_per_job_and_team():
    allocations = [AllocationRow("a1", "H100-80GB", 8000, ms(0), ms(2 * H)),
                   AllocationRow("b1", "A100-40GB", 4000, ms(H), ms(2 * H), lost_ms=600_000)]
    usage = [UsageRow("a1", "H100-80GB", T0_MS, used_gpu_ms=8 * HOUR_MS // 2),  # 50% in hour 1
             UsageRow("a1", "H100-80GB", T0_MS + HOUR_MS, used_gpu_ms=8 * HOUR_MS),  # 100% in hour 2
             UsageRow("b1", "A100-40GB", T0_MS + HOUR_MS, used_gpu_ms=HOUR_MS, energy_mj=3_600_000_000)]
    # Lost work counts in the hour of the preemption (2 h after T0): the window must include that hour.
    cells = build_cells(allocations, usage, since_ms=ms(0), until_ms=ms(3 * H), horizon_ms=ms(3 * H))
    rows = rollup(cells, DIMS, by=("team",), since_ms=ms(0), until_ms=ms(3 * H),
                  rates={"H100-80GB": 4.0, "A100-40GB": 2.0})
    by_team = {r.key[0]: r.totals for r in rows}
    a, b = by_team["team-a"], by_team["team-b"]
    assert a.allocated_gpu_ms == 16 * HOUR_MS and a.used_gpu_ms == 12 * HOUR_MS and a.idle_gpu_ms == 4 * HOUR_MS
    assert a.cost == pytest.approx(64.0) and a.idle_cost == pytest.approx(16.0)
    assert b.allocated_gpu_ms == 4 * HOUR_MS and b.idle_gpu_ms == 3 * HOUR_MS and b.lost_gpu_ms == 600_000
    assert b.cost == pytest.approx(8.0) and b.energy_mj == 3_600_000_000
    assert grand_total(rows).allocated_gpu_ms == 20 * HOUR_MS


def test_idle_is_clamped_per_cell_not_netted_across_jobs():
    # a1 is over-sampled (used > allocated in its hour); b1 is idle: b1's waste must stay visible.
    allocations = [AllocationRow("a1", "H100-80GB", 1000, ms(0), ms(H)),
                   AllocationRow("b1", "H100-80GB", 1000, ms(0), ms(H))]
    usage = [UsageRow("a1", "H100-80GB", T0_MS, used_gpu_ms=2 * HOUR_MS)]
    cells = build_cells(allocations, usage, since_ms=ms(0), until_ms=ms(H), horizon_ms=ms(H))
    (row,) = rollup(cells, DIMS, by=("gpu_model",), since_ms=ms(0), until_ms=ms(H))
    assert row.totals.idle_gpu_ms == HOUR_MS


def test_window_clips_allocations_and_open_ones_run_to_the_horizon():
    allocations = [AllocationRow("a1", "H100-80GB", 2000, ms(-H), None)]
    cells = build_cells(allocations, [], since_ms=ms(0), until_ms=ms(3 * H), horizon_ms=ms(H + 900))
    assert sum(c.allocated_gpu_ms for c in cells) == 2 * (H + 900) * 1000
    assert {c.hour_ms for c in cells} == {T0_MS, T0_MS + HOUR_MS}


def test_window_is_widened_to_whole_hours():
    allocations = [AllocationRow("a1", "H100-80GB", 1000, ms(0), ms(2 * H))]
    cells = build_cells(allocations, [], since_ms=ms(600), until_ms=ms(H + 60), horizon_ms=ms(2 * H))
    assert sum(c.allocated_gpu_ms for c in cells) == 2 * HOUR_MS


def test_group_by_labels_day_granularity_and_unknown_jobs():
    allocations = [AllocationRow("a1", "H100-80GB", 1000, ms(0), ms(H)),
                   AllocationRow("b1", "H100-80GB", 1000, ms(0), ms(H)),
                   AllocationRow("zz", "H100-80GB", 1000, ms(0), ms(H))]
    cells = build_cells(allocations, [], since_ms=ms(0), until_ms=ms(H), horizon_ms=ms(H))
    rows = rollup(cells, DIMS, by=("feature", "project"), granularity=Granularity.DAY, since_ms=ms(0),
                  until_ms=ms(H))
    assert [r.key for r in rows] == [("(none)", "(none)"), ("ads", "p9"), ("search", "(none)")]
    assert {r.period_end_ms - r.period_start_ms for r in rows} == {24 * HOUR_MS}
    team_rows = rollup(cells, DIMS, by=("team", "label:project"), since_ms=ms(0), until_ms=ms(H))
    assert ("(unknown)", "(none)") in [r.key for r in team_rows]


def test_unpriced_models_use_the_config_default_rate():
    cells = build_cells([AllocationRow("a1", "T4", 1000, ms(0), ms(H))], [], since_ms=ms(0), until_ms=ms(H),
                        horizon_ms=ms(H))
    (row,) = rollup(cells, DIMS, by=("team",), since_ms=ms(0), until_ms=ms(H), rates={"H100-80GB": 9.0})
    assert row.totals.cost == pytest.approx(1.0)


def test_team_summary_table_for_the_demo():
    allocations = [AllocationRow("a1", "H100-80GB", 8000, ms(0), ms(H)),
                   AllocationRow("b1", "H100-80GB", 8000, ms(0), None)]
    usage = [UsageRow("a1", "H100-80GB", T0_MS, used_gpu_ms=2 * HOUR_MS)]
    table = team_summary_table(allocations, usage, DIMS, horizon_ms=ms(H // 2), rates={"H100-80GB": 3.0})
    assert table == [
        {"team": "team-a", "jobs": 1, "allocated_gpu_hours": 8.0, "used_gpu_hours": 2.0, "idle_gpu_hours": 6.0,
         "lost_gpu_hours": 0.0, "cost": 24.0},
        {"team": "team-b", "jobs": 1, "allocated_gpu_hours": 4.0, "used_gpu_hours": 0.0, "idle_gpu_hours": 4.0,
         "lost_gpu_hours": 0.0, "cost": 12.0},
    ]
    assert team_summary_table([], [], DIMS, horizon_ms=ms(0)) == []


_alloc = st.builds(
    lambda job, start, length, milli, open_: AllocationRow(job, "H100-80GB", milli, ms(start),
                                                          None if open_ else ms(start + length)),
    st.sampled_from(["a1", "b1"]), st.integers(0, 48 * H), st.integers(0, 24 * H), st.sampled_from([142, 1000, 8000]),
    st.booleans())


@settings(max_examples=150, deadline=None)
@given(st.lists(_alloc, max_size=10), st.integers(0, 72), st.integers(1, 72))
def test_hourly_rows_add_up_to_the_total(allocations, since_h, span_h):
    since, until = ms(since_h * H), ms((since_h + span_h) * H)
    cells = build_cells(allocations, [], since_ms=since, until_ms=until, horizon_ms=ms(80 * H))
    total = rollup(cells, DIMS, by=("team",), since_ms=since, until_ms=until)
    hourly = rollup(cells, DIMS, by=("team",), granularity=Granularity.HOUR, since_ms=since, until_ms=until)
    assert grand_total(total).allocated_gpu_ms == grand_total(hourly).allocated_gpu_ms
    assert all(until > r.period_start_ms >= since for r in hourly)
    held = sum(a.milli_gpus for a in allocations)
    assert all(r.totals.allocated_gpu_ms <= held * HOUR_MS // 1000 for r in hourly)
