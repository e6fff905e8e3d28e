"""A pod set without GPUs (a launcher beside its workers) holds no GPU: the scheduler binds it to no GPU index or
MIG slice, metering's shares leave it out (no GPU-hours, no energy), and the simulated executor counts only the
workers' GPUs in its run (the GPU time a failure loses). A job whose every pod set asks for no GPU is refused at
submission (tests/service/admission/test_admission_config_safety.py)."""

from __future__ import annotations

from shared.domain import GpuBinding, JobSpec, PodSet, node_shares
from shared.events import JobAdmitted
from tests.service.executor.test_sim_job_path import DURATION_LABEL, T0, Path, decode_event, path

__all__ = ["path"]  # the fixture, from the job path's tests


async def test_a_launcher_pod_set_holds_no_gpu_and_is_not_counted_as_gpu_time(path: Path) -> None:
    spec = JobSpec(job_id="mixed", team="t", queue="t", max_runtime_s=3600, labels={DURATION_LABEL: "600"},
                   pod_sets=(PodSet(name="launcher", count=1, gpus_per_pod=0),
                             PodSet(name="workers", count=2, gpus_per_pod=1)))
    await path.to_scheduler(JobAdmitted(job_id="mixed", spec=spec, flavors={"workers": "H100"}, admitted_at=T0))
    [placed] = await path.placements("mixed")
    bindings = [GpuBinding.model_validate(b) for b in decode_event(placed).data["bindings"]]
    launcher = [b for b in bindings if b.pod.startswith("launcher-")]
    assert len(launcher) == 1 and launcher[0].gpu_indices == () and launcher[0].mig_slice is None
    assert sum(milli for _, milli in node_shares(bindings, spec)) == 2000  # the two workers' GPUs, charged
    assert await path.runtime.handle(placed) == "handled"
    assert (await path.run("mixed"))["gpus"] == 2
