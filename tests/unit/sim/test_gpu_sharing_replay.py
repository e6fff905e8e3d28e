"""openb's fractional pods replayed as fractions (issue 47): the loader's sharing modes, the gpuq policy placing
them on shared GPUs through the production cores, and the Volcano/HAMi-like baseline's per-GPU packing."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from shared.domain import GpuSharing, NodeSpec, SharingMode
from sim.engine import Engine
from sim.loaders import TraceError, load_openb, queues_for_teams
from sim.model import Trace, TraceJob
from sim.policies.gpuq import GpuqPolicy
from sim.policies.hami import SharedFit, VolcanoHami
from tests.unit.sim.conftest import nodes


def _slice(src: Path, dst: Path, rows: int) -> Path:
    with src.open() as fh:
        dst.write_text("".join(next(fh) for _ in range(rows + 1)))
    return dst


@pytest.mark.parametrize("mode", ["time-slicing", "mps"])
def test_openb_fractions_become_shares_on_shared_nodes(traces_dir: Path, tmp_path: Path, mode: str) -> None:
    path = _slice(traces_dir / "openb_pod_list_gpuspec33.csv", tmp_path / "pods.csv", 400)
    nodes_path = traces_dir / "openb_node_list_gpu_node.csv"
    tr = load_openb(path, nodes_path=nodes_path, sharing=mode)
    shares = [j for j in tr.jobs if j.share_milli]
    assert shares and all(0 < j.share_milli < 1000 and j.mig_profile is None and j.gpus == 0 for j in shares)
    assert not any(j.mig_profile for j in tr.jobs)
    shared = [n for n in tr.nodes if n.sharing is not None]
    assert shared and all(n.sharing is not None and n.sharing.mode is SharingMode(mode) and n.mig is None
                          for n in shared)
    smallest = min(j.share_milli for j in shares)
    assert {n.sharing.replicas for n in shared if n.sharing is not None} == {1000 // smallest}
    quotas = tr.queues.queues[0].quotas
    assert sum(v.nominal for k, v in quotas.items() if k.endswith(":gpu-share")) == 1000 * sum(
        n.gpus for n in shared)
    assert tr.gpu_milli(shares[0]) == shares[0].share_milli
    spec = shares[0].spec()
    assert spec.pod_sets[0].gpu_fraction == shares[0].share_milli / 1000
    # the shared nodes are sized by what the fractions need: one above half a GPU holds its GPU alone
    need = sum(j.duration * (1000 if j.share_milli > 500 else j.share_milli) for j in shares) / 1000
    whole = sum(j.duration * j.gpus for j in tr.jobs)
    assert tr.info["shared_node_fraction"] == round(need / (need + whole), 4)
    assert any(j.share_milli > 500 for j in shares)
    rounded = load_openb(path, nodes_path=nodes_path)  # the old replay is unchanged by default
    assert not any(j.share_milli for j in rounded.jobs) and any(j.mig_profile for j in rounded.jobs)
    with pytest.raises(TraceError, match="unknown GPU sharing 'vgpu'"):
        load_openb(path, nodes_path=nodes_path, sharing="vgpu")


def _shared_trace(jobs: list[TraceJob]) -> Trace:
    sharing = GpuSharing(mode=SharingMode.TIME_SLICING, replicas=4)
    ns = [NodeSpec.model_validate({**n.model_dump(), "sharing": sharing}) for n in nodes(1, gpus=2)]
    return Trace(name="tiny", jobs=jobs, nodes=ns,
                 queues=queues_for_teams(["a"], {"gpu:gpu-share": 2000}))


def _job(job_id: str, share: int, submit: int = 0, duration: int = 100) -> TraceJob:
    return TraceJob(job_id=job_id, submit_time=submit, duration=duration, team="a", queue="a", gpus_per_pod=1,
                    gpu_models=("gpu",), share_milli=share, max_runtime_s=duration)


def test_gpuq_replays_fractions_on_shared_gpus() -> None:
    # 2 shared GPUs: 4 pods of 0.5 run at once, the fifth waits for one to end (rounded, 2 would run)
    jobs = [_job(f"j{i}", 500) for i in range(5)]
    res = Engine(_shared_trace(jobs), GpuqPolicy()).run()
    starts = sorted(r.start for r in res.records.values() if r.start is not None)
    assert starts == [0, 0, 0, 0, 100]


def test_the_hami_baseline_packs_fractions_per_gpu_and_keeps_whole_gpus_apart() -> None:
    fit = SharedFit(nodes(2, gpus=2))
    a = fit.place_pod((), True, 600)
    b = fit.place_pod((), True, 600)  # does not fit beside the first: the node's second GPU
    assert a is not None and b is not None and a[1] == 0 and b[1] == 1
    whole = fit.place_pod((), True, 2000)  # 2 whole GPUs: only the second node has them
    assert whole is not None and whole[1] == -2
    assert fit.place_pod((), True, 1000) is None  # no GPU entirely free is left
    small = fit.place_pod((), True, 400)
    assert small is not None and small[1] == 0  # first fit: beside the first pod
    fit.free(*whole, 2000)
    assert fit.place_pod((), True, 2000) is not None
    policy = VolcanoHami()
    policy.setup(_shared_trace([_job("x", 250)]))
    assert policy._gang(_job("x", 250)).units == 250


def test_rounding_policies_are_refused_with_fractions(traces_dir: Path) -> None:
    from cli.main import app

    res = CliRunner().invoke(app, ["simulate", "--trace", str(traces_dir / "openb_pod_list_gpuspec33.csv"),
                                   "--policy", "gpuq,volcano", "--gpu-sharing", "mps"], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "volcano cannot share a GPU" in res.output, res.output
