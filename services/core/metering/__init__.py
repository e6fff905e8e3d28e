"""Metering's pure core: ledger arithmetic in integers, allocation segments, rollups and FOCUS rows.

No I/O, no clock reads, no asyncio: the store feeds rows in, reports take figures out.
"""

from services.core.metering.focus import FOCUS_COLUMNS, focus_rows
from services.core.metering.rollup import (
    AllocationRow,
    Cell,
    Granularity,
    JobDims,
    RollupRow,
    Totals,
    UsageRow,
    build_cells,
    grand_total,
    rollup,
    team_summary_table,
)
from services.core.metering.segments import AllocationPart, Fact, FactKind, build_segments

__all__ = [
    "FOCUS_COLUMNS", "AllocationPart", "AllocationRow", "Cell", "Fact", "FactKind", "Granularity", "JobDims",
    "RollupRow", "Totals", "UsageRow", "build_cells", "build_segments", "focus_rows", "grand_total", "rollup",
    "team_summary_table",
]
