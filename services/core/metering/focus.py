"""FinOps FOCUS export: one charge row per job, GPU model and charge period.

Targets FOCUS 1.0 (the FinOps Open Cost and Usage Specification, version 1.0): every column that version
defines is present, null (an empty CSV field) where gpuq has nothing to say. gpuq is the "provider" of an
internal showback: there are no discounts or commitments (the CommitmentDiscount* columns are null), no regions
or zones (RegionId, RegionName, AvailabilityZone are null), so ListCost = ContractedCost = EffectiveCost =
BilledCost = allocated GPU-hours × the model's cost_per_gpu_hour. Consumption is measured in allocated
GPU-hours (what the team held, used or not: a pod holding a quarter of a shared GPU is charged a quarter of the
hours it held it); gpuq's own figures are in `x_`-prefixed columns, the FOCUS convention for custom columns
(`x_GpuShare`: the GPUs held at once, a fraction for a job sharing a GPU).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from services.core.metering.rollup import DEFAULT_RATE, Cell, Granularity, JobDims, rollup
from services.core.metering.units import HOUR_MS, from_ms, mj_to_kwh

FOCUS_VERSION = "1.0"
# Every column FOCUS 1.0 defines (its column library, in its alphabetical order): mandatory, conditional and
# recommended ones alike, so that no consumer finds one missing.
FOCUS_1_0_COLUMNS: tuple[str, ...] = (
    "AvailabilityZone", "BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency",
    "BillingPeriodEnd", "BillingPeriodStart", "ChargeCategory", "ChargeClass", "ChargeDescription",
    "ChargeFrequency", "ChargePeriodEnd", "ChargePeriodStart", "CommitmentDiscountCategory", "CommitmentDiscountId",
    "CommitmentDiscountName", "CommitmentDiscountStatus", "CommitmentDiscountType", "ConsumedQuantity",
    "ConsumedUnit", "ContractedCost", "ContractedUnitPrice", "EffectiveCost", "InvoiceIssuerName", "ListCost",
    "ListUnitPrice", "PricingCategory", "PricingQuantity", "PricingUnit", "ProviderName", "PublisherName",
    "RegionId", "RegionName", "ResourceId", "ResourceName", "ResourceType", "ServiceCategory", "ServiceName",
    "SkuId", "SkuPriceId", "SubAccountId", "SubAccountName", "Tags",
)
GPUQ_COLUMNS: tuple[str, ...] = (
    "x_UsedGpuHours", "x_IdleGpuHours", "x_IdleCost", "x_LostGpuHours", "x_EnergyKwh", "x_Queue", "x_PriorityClass",
    "x_GpuShare",
)
FOCUS_COLUMNS: tuple[str, ...] = FOCUS_1_0_COLUMNS + GPUQ_COLUMNS
# Columns gpuq has no value for: null in every row (commitment discounts, regions and zones do not exist here;
# ChargeClass is null except on corrections, which gpuq does not issue).
NULL_COLUMNS: tuple[str, ...] = (
    "AvailabilityZone", "ChargeClass", "CommitmentDiscountCategory", "CommitmentDiscountId", "CommitmentDiscountName",
    "CommitmentDiscountStatus", "CommitmentDiscountType", "RegionId", "RegionName",
)
NULL = ""  # a null in the CSV export

GPU_HOURS = "GPU-Hours"


def _iso(ms: int) -> str:
    return from_ms(ms).strftime("%Y-%m-%dT%H:%M:%SZ")


def _month_bounds(ms: int) -> tuple[str, str]:
    d = from_ms(ms)
    start = datetime(d.year, d.month, 1, tzinfo=UTC)
    end = datetime(d.year + (d.month == 12), d.month % 12 + 1, 1, tzinfo=UTC)
    return start.strftime("%Y-%m-%dT%H:%M:%SZ"), end.strftime("%Y-%m-%dT%H:%M:%SZ")


def focus_rows(cells: Sequence[Cell], dims: Mapping[str, JobDims], *, since_ms: int, until_ms: int,
               granularity: Granularity = Granularity.DAY, rates: Mapping[str, float] | None = None,
               default_rate: float = DEFAULT_RATE, currency: str = "USD",
               billing_account: str = "gpuq") -> list[dict[str, str]]:
    """FOCUS rows (all values as strings, ready for csv.DictWriter), sorted by period, job and model."""
    if granularity is Granularity.TOTAL:
        raise ValueError("a FOCUS export needs charge periods: use hour or day granularity")
    rates = rates or {}
    rows = rollup(cells, dims, by=("job", "gpu_model"), granularity=granularity, since_ms=since_ms,
                  until_ms=until_ms, rates=rates, default_rate=default_rate)
    out: list[dict[str, str]] = []
    for r in sorted(rows, key=lambda r: (r.period_start_ms, r.key)):
        t = r.totals
        if not (t.allocated_gpu_ms or t.used_gpu_ms or t.lost_gpu_ms):
            continue
        job_id, model = r.key
        job = dims.get(job_id) or JobDims(job_id)
        rate = rates.get(model, default_rate)
        gpu_hours = t.allocated_gpu_ms / HOUR_MS
        cost = f"{t.cost:.6f}"
        bp_start, bp_end = _month_bounds(r.period_start_ms)
        out.append({
            **dict.fromkeys(NULL_COLUMNS, NULL),
            "BilledCost": cost, "EffectiveCost": cost, "ListCost": cost, "ContractedCost": cost,
            "BillingCurrency": currency,
            "BillingAccountId": billing_account, "BillingAccountName": billing_account,
            "BillingPeriodStart": bp_start, "BillingPeriodEnd": bp_end,
            "ChargePeriodStart": _iso(r.period_start_ms), "ChargePeriodEnd": _iso(r.period_end_ms),
            "ChargeCategory": "Usage", "ChargeFrequency": "Usage-Based",
            "ChargeDescription": f"{model} GPU time allocated to job {job_id}",
            "PricingCategory": "Standard",
            "ConsumedQuantity": f"{gpu_hours:.6f}", "ConsumedUnit": GPU_HOURS,
            "PricingQuantity": f"{gpu_hours:.6f}", "PricingUnit": GPU_HOURS,
            "ListUnitPrice": f"{rate:.6f}", "ContractedUnitPrice": f"{rate:.6f}",
            "ProviderName": "gpuq", "PublisherName": "gpuq", "InvoiceIssuerName": "gpuq",
            "ServiceName": "gpuq GPU training", "ServiceCategory": "AI and Machine Learning",
            "ResourceId": job_id, "ResourceName": job_id, "ResourceType": f"{job.kind} job",
            "SkuId": model, "SkuPriceId": f"{model}/gpu-hour",
            "SubAccountId": job.team, "SubAccountName": job.team,
            "Tags": json.dumps(job.tags(), sort_keys=True, separators=(",", ":")),
            "x_UsedGpuHours": f"{t.used_gpu_ms / HOUR_MS:.6f}",
            "x_IdleGpuHours": f"{t.idle_gpu_ms / HOUR_MS:.6f}",
            "x_IdleCost": f"{t.idle_cost:.6f}",
            "x_LostGpuHours": f"{t.lost_gpu_ms / HOUR_MS:.6f}",
            "x_EnergyKwh": f"{mj_to_kwh(t.energy_mj):.6f}",
            "x_Queue": job.queue, "x_PriorityClass": job.priority_class,
            # GPUs the job held at once in the period: a fraction for a pod sharing a GPU (0.250), 8.000 for 8 GPUs
            "x_GpuShare": f"{t.held_milli / 1000:.3f}",
        })
    return out
