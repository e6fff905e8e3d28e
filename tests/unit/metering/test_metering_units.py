from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.metering.samples import sample_columns
from services.core.metering.units import (
    binding_milli_gpus,
    ceil_to,
    floor_to,
    from_ms,
    mig_milli_gpus,
    node_shares,
    sample_energy_mj,
    sample_used_gpu_ms,
    split_lost,
    to_ms,
)
from services.metering.testing import T0, T0_MS, sampled, spec
from shared.domain import GpuBinding


def test_to_ms_is_exact_and_zone_independent():
    assert to_ms(T0) == T0_MS
    assert to_ms(T0.astimezone(timezone(timedelta(hours=-5)))) == T0_MS
    assert to_ms(T0.replace(tzinfo=None)) == T0_MS  # naive = UTC
    assert to_ms(T0 + timedelta(microseconds=1999)) == T0_MS + 1
    assert from_ms(T0_MS) == T0


def test_floor_and_ceil():
    assert floor_to(3_599_999, 3_600_000) == 0
    assert ceil_to(3_600_001, 3_600_000) == 7_200_000
    assert ceil_to(3_600_000, 3_600_000) == 3_600_000


def test_mig_share_from_profile():
    assert mig_milli_gpus("1g.10gb") == 142
    assert mig_milli_gpus("3g.40gb") == 428
    assert mig_milli_gpus("7g.80gb") == 1000
    assert mig_milli_gpus("weird") == 142
    assert mig_milli_gpus(None) == 142


def test_binding_shares_whole_gpus_and_mig():
    job = spec("j1", gpus=8, pods=2)
    assert binding_milli_gpus(GpuBinding(pod="main-0", node="n1", gpu_indices=(0, 1, 2, 3)), job) == 4000
    mig = spec("j2", pods=3, mig_profile="2g.20gb")
    assert binding_milli_gpus(GpuBinding(pod="main-1", node="n1", mig_slice=(0, 2)), mig) == 285
    shares = node_shares([GpuBinding(pod="main-0", node="n2", gpu_indices=(0,)),
                          GpuBinding(pod="main-1", node="n1", gpu_indices=(0, 1)),
                          GpuBinding(pod="main-2", node="n2", gpu_indices=(1,))], spec("j3", gpus=4, pods=4))
    assert shares == (("n1", 2000), ("n2", 2000))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**12), st.lists(st.integers(0, 8000), min_size=1, max_size=8))
def test_split_lost_is_exact(lost, shares):
    parts = split_lost(lost, tuple((f"n{i}", m) for i, m in enumerate(shares)))
    assert sum(parts) == lost
    assert all(p >= 0 for p in parts)


def test_sample_arithmetic_rounds_once():
    assert sample_used_gpu_ms(50.0, 10_000) == 5_000
    assert sample_used_gpu_ms(33.3, 1_000) == 333
    assert sample_energy_mj(400.0, 60_000) == 24_000_000  # 400 W for a minute = 24 kJ


def test_sample_columns_flatten_a_node_batch():
    cols = sample_columns([sampled("n1", 60, "j1", [100, 50, 0, 25]), sampled("n2", 60, None, [10], model=None)])
    assert len(cols) == 5
    assert cols.used_gpu_ms == [60_000, 30_000, 0, 15_000, 6_000]
    assert cols.job_id == ["j1", "j1", "j1", "j1", None]
    assert cols.model_node == ["n1"] and cols.model_name == ["H100-80GB"]
    assert cols.sampled_at[0] == datetime(2025, 1, 6, 9, 1, tzinfo=UTC) == T0 + timedelta(seconds=60)
