import json

import pytest

from services.core.metering.focus import FOCUS_COLUMNS, focus_rows
from services.core.metering.rollup import AllocationRow, Granularity, JobDims, UsageRow, build_cells
from services.core.metering.units import HOUR_MS
from services.metering.testing import T0_MS, ms

H = 3600
DIMS = {"a1": JobDims("a1", "team-a", "team-a", "normal", "training", labels=(("feature", "search"),))}


def _cells():
    allocations = [AllocationRow("a1", "H100-80GB", 8000, ms(23 * H), ms(26 * H))]  # Jan 7, 08:00-11:00 UTC
    usage = [UsageRow("a1", "H100-80GB", T0_MS + 23 * HOUR_MS, used_gpu_ms=4 * HOUR_MS, energy_mj=7_200_000_000)]
    return build_cells(allocations, usage, since_ms=ms(0), until_ms=ms(48 * H), horizon_ms=ms(48 * H))


def test_focus_columns_are_the_spec_names():
    for col in ("BilledCost", "EffectiveCost", "ChargePeriodStart", "ChargePeriodEnd", "ResourceId", "ResourceName",
                "ServiceName", "ConsumedQuantity", "ConsumedUnit", "PricingQuantity", "PricingUnit", "Tags"):
        assert col in FOCUS_COLUMNS
    assert all(c[0].isupper() or c.startswith("x_") for c in FOCUS_COLUMNS)


def test_focus_rows_per_job_model_and_day():
    rows = focus_rows(_cells(), DIMS, since_ms=ms(0), until_ms=ms(48 * H), rates={"H100-80GB": 2.5})
    # 24 GPU-hours from 08:00 to 11:00 on Jan 7 (T0 is Jan 6 09:00): all on one UTC day.
    assert len(rows) == 1
    (row,) = rows
    assert set(row) == set(FOCUS_COLUMNS)
    assert row["ChargePeriodStart"] == "2025-01-07T00:00:00Z" and row["ChargePeriodEnd"] == "2025-01-08T00:00:00Z"
    assert row["BillingPeriodStart"] == "2025-01-01T00:00:00Z" and row["BillingPeriodEnd"] == "2025-02-01T00:00:00Z"
    assert float(row["ConsumedQuantity"]) == pytest.approx(24.0) and row["ConsumedUnit"] == "GPU-Hours"
    assert float(row["BilledCost"]) == pytest.approx(60.0) == float(row["EffectiveCost"])
    assert float(row["x_IdleGpuHours"]) == pytest.approx(20.0)
    assert float(row["x_EnergyKwh"]) == pytest.approx(2.0)
    assert row["ResourceId"] == "a1" and row["SkuId"] == "H100-80GB" and row["SubAccountName"] == "team-a"
    assert json.loads(row["Tags"]) == {"feature": "search", "kind": "training", "priority_class": "normal",
                                       "queue": "team-a", "team": "team-a"}


def test_focus_hourly_rows_sum_to_the_daily_cost():
    hourly = focus_rows(_cells(), DIMS, since_ms=ms(0), until_ms=ms(48 * H), granularity=Granularity.HOUR)
    assert len(hourly) == 3
    assert sum(float(r["BilledCost"]) for r in hourly) == pytest.approx(24.0)
    with pytest.raises(ValueError):
        focus_rows(_cells(), DIMS, since_ms=ms(0), until_ms=ms(H), granularity=Granularity.TOTAL)
