"""Metering in fractions (issue 47): a pod holding part of a shared GPU is charged that part of the hours it held
it, and its FOCUS rows carry the fraction (x_GpuShare)."""

import pytest

from services.core.metering.focus import focus_rows
from services.core.metering.rollup import AllocationRow, JobDims, build_cells
from services.core.metering.units import node_shares
from services.metering.testing import ms
from shared.domain import GpuBinding, JobSpec, PodSet, SharingMode

H = 3600


def test_a_shared_placement_holds_its_fraction_per_node() -> None:
    spec = JobSpec(job_id="nb", team="t", queue="t", pod_sets=(PodSet(name="w", count=3, gpu_fraction=0.25),))
    bindings = [GpuBinding(pod=f"w-{i}", node=node, shared_gpu=0, share_milli=250, sharing=SharingMode.MPS)
                for i, node in enumerate(("n1", "n1", "n2"))]
    assert node_shares(bindings, spec) == (("n1", 500), ("n2", 250))


def test_focus_rows_charge_and_carry_the_fraction() -> None:
    allocations = [AllocationRow("nb", "A100", 250, ms(0), ms(4 * H)),  # a quarter of a GPU for 4 hours
                   AllocationRow("tr", "A100", 8000, ms(0), ms(H)),
                   AllocationRow("tr", "A100", 8000, ms(0), ms(H))]  # two nodes of one placement: 16 GPUs
    cells = build_cells(allocations, [], since_ms=ms(0), until_ms=ms(24 * H), horizon_ms=ms(24 * H))
    dims = {j: JobDims(j, "t", "t", "normal", "training") for j in ("nb", "tr")}
    rows = {r["ResourceId"]: r for r in focus_rows(cells, dims, since_ms=ms(0), until_ms=ms(24 * H),
                                                   rates={"A100": 2.0})}
    assert float(rows["nb"]["ConsumedQuantity"]) == pytest.approx(1.0)  # 0.25 GPU x 4 h
    assert float(rows["nb"]["BilledCost"]) == pytest.approx(2.0)
    assert rows["nb"]["x_GpuShare"] == "0.250"
    assert rows["tr"]["x_GpuShare"] == "16.000" and float(rows["tr"]["ConsumedQuantity"]) == pytest.approx(16.0)
