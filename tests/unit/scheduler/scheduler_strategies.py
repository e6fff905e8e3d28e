"""Hypothesis strategies for placement-core properties: small random clusters and jobs."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from shared.domain import (
    JobSpec,
    MigLayout,
    NodeAffinity,
    NodeHealth,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    NodeSpec,
    NodeUsage,
    PlacementRefusal,
    PodSet,
    PodShape,
    PreferredSchedulingTerm,
    Taint,
    TaintEffect,
    Toleration,
    TopologyLevel,
    TopologyRequest,
)

MODELS = ("H100-80GB", "A100-80GB")
MIG = MigLayout(profile="1g.10gb", slices_per_gpu=7)
TAINT = Taint(key="pool", value="inference", effect=TaintEffect.NO_SCHEDULE)
SOFT = Taint(key="spot", value="yes", effect=TaintEffect.PREFER_NO_SCHEDULE)
POOLS = ({}, {"pool": "a"}, {"pool": "b"})
NOT_B = NodeAffinity(required=(NodeSelectorTerm(match_expressions=(
    NodeSelectorRequirement(key="pool", operator="NotIn", values=("b",)),)),))
PREFER_A = NodeAffinity(preferred=(PreferredSchedulingTerm(weight=10, preference=NodeSelectorTerm(match_expressions=(
    NodeSelectorRequirement(key="pool", operator="In", values=("a",)),))),))
REFUSED = (PlacementRefusal(shape=PodShape(gpus=2), reason="OutOfnvidia.com/gpu", job_id="earlier"),)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def clusters(draw: st.DrawFn) -> list[NodeSpec]:
    count = draw(st.integers(1, 12))
    per_rack = draw(st.integers(1, 4))
    out = []
    for i in range(count):
        rack = i // per_rack
        gpus = draw(st.sampled_from((0, 1, 2, 4, 8)))
        mig = MIG if draw(st.integers(0, 5)) == 0 else None
        held = NodeUsage()
        if draw(st.integers(0, 3)) == 0:  # pods gpuq does not manage hold part of it
            held = NodeUsage(gpus=0 if mig else draw(st.integers(0, gpus)),
                             mig_slices=draw(st.integers(0, gpus * MIG.slices_per_gpu)) if mig else 0,
                             cpu_milli=draw(st.sampled_from((0, 2000))), memory_mib=draw(st.sampled_from((0, 8192))))
        out.append(NodeSpec(
            name=f"n-{i}", gpus=gpus, gpu_model=draw(st.sampled_from(MODELS)),
            cpu_milli=draw(st.sampled_from((4000, 16000, 96000))), memory_mib=draw(st.sampled_from((16384, 262144))),
            mig=mig, taints=draw(st.sampled_from(((), (), (TAINT,), (SOFT,)))),
            health=draw(st.sampled_from((NodeHealth.READY,) * 5 + (NodeHealth.CORDONED, NodeHealth.FAILED))),
            datasets=draw(st.sampled_from(((), ("imagenet",)))), rack=f"rack{rack}", block=f"block{rack // 2}",
            labels=draw(st.sampled_from(POOLS)), held=held,
            refused=draw(st.sampled_from(((),) * 5 + (REFUSED,)))))
    return out


@st.composite
def jobs(draw: st.DrawFn, job_id: str) -> JobSpec:
    sets = []
    for k in range(draw(st.integers(1, 2))):
        mig = draw(st.integers(0, 4)) == 0
        sets.append(PodSet(
            name=f"ps{k}", count=draw(st.integers(1, 5)), gpus_per_pod=1 if mig else draw(st.integers(0, 4)),
            gpu_models=draw(st.sampled_from(((), ("H100-80GB",), ("A100-80GB",), MODELS))),
            mig_profile="1g.10gb" if mig else None,
            cpu_milli=draw(st.sampled_from((0, 1000, 8000))), memory_mib=draw(st.sampled_from((0, 4096, 65536))),
            node_selector=draw(st.sampled_from(({},) * 4 + ({"pool": "a"},))),
            affinity=draw(st.sampled_from((None,) * 4 + (NOT_B, PREFER_A)))))
    total = sum(p.count for p in sets)
    level = draw(st.sampled_from((None, *TopologyLevel)))
    required = draw(st.booleans())
    topo = TopologyRequest(required_level=level if required else None, preferred_level=None if required else level)
    return JobSpec(
        job_id=job_id, team="t", queue="q", pod_sets=tuple(sets), topology=topo,
        min_members=draw(st.one_of(st.none(), st.integers(1, total))),
        tolerations=draw(st.sampled_from(((), (Toleration(key="pool", operator="Exists"),)))),
        datasets=draw(st.sampled_from(((), ("imagenet",)))),
        max_runtime_s=draw(st.integers(60, 10_000)))
