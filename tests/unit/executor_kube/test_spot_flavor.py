"""The spot flavor: nodes matching kubernetes.spot_selector carry gpuq's own taint, which only the preemptible jobs of
queues with spot_for_preemptible tolerate (given at intake), so nothing else is ever placed there."""

from __future__ import annotations

from typing import Any

from services.core.kube.intake import Refusal, job_spec
from services.core.kube.kinds import kind_of
from services.core.kube.nodes import node_spec
from shared.config import KubernetesSource, QueuesConfig, parse_queues
from shared.domain import Taint, TaintEffect
from tests.unit.executor_kube.conftest import QUEUES, job, node

JOB = kind_of("batch/v1", "Job")
SPOT = Taint(key="gpuq.io/spot", value="true", effect=TaintEffect.NO_SCHEDULE)
SELECTOR = {"karpenter.sh/capacity-type": "spot"}


def with_spot(cfg: KubernetesSource) -> KubernetesSource:
    return cfg.model_copy(update={"spot_selector": SELECTOR})


def spot_queues() -> QueuesConfig:
    doc: dict[str, Any] = {**QUEUES, "queues": [{**QUEUES["queues"][0], "spot_for_preemptible": True},
                                                  QUEUES["queues"][1]]}
    return parse_queues(doc)


def test_spot_nodes_carry_gpuqs_taint(kube_cfg: KubernetesSource) -> None:
    spot = node("s1", labels=SELECTOR)
    assert SPOT in node_spec(spot, with_spot(kube_cfg)).taints
    assert SPOT not in node_spec(node("n1"), with_spot(kube_cfg)).taints
    assert SPOT not in node_spec(spot, kube_cfg).taints  # no selector: no spot flavor


def test_only_preemptible_jobs_of_a_queue_that_allows_it_tolerate_spot(queues: QueuesConfig,
                                                                       kube_cfg: KubernetesSource) -> None:
    def tolerates(obj: dict[str, Any], config: QueuesConfig) -> bool:
        spec = job_spec(JOB, obj, config, kube_cfg)
        assert not isinstance(spec, Refusal)
        return all(any(t.tolerates(SPOT) for t in ps.tolerations) for ps in spec.pod_sets) and \
            any(t.tolerates(SPOT) for t in spec.tolerations)

    assert tolerates(job(), spot_queues())  # "normal" is preemptible
    assert not tolerates(job(labels={"gpuq.io/priority-class": "high"}), spot_queues())  # never preempted
    assert not tolerates(job(annotations={"gpuq.io/preemptible": "false"}), spot_queues())
    assert not tolerates(job(), queues)  # the queue did not opt in
    assert not tolerates(job(namespace="ml-b", labels={"gpuq.io/queue": "team-b"}), spot_queues())
