"""Placement: gated templates restricted to gpuq's nodes, per-pod ungating, event-submitted Indexed Jobs."""

from __future__ import annotations

from services.core.kube import names as n
from services.core.kube.kinds import kind_of
from services.core.kube.placement import (
    assign_pods,
    event_pod_sets,
    placed_templates,
    ungate_patch,
)
from shared.domain import (
    EnvVar,
    GpuBinding,
    JobSpec,
    NodeAffinity,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    PodSet,
    PodTemplate,
    Toleration,
)
from tests.unit.executor_kube.conftest import job, pod_template

JOB = kind_of("batch/v1", "Job")
BINDINGS = (GpuBinding(pod="main-0", node="gpu-1", gpu_indices=tuple(range(8))),
            GpuBinding(pod="main-1", node="gpu-2", gpu_indices=tuple(range(8))))
SPEC = JobSpec(job_id="ml-a.sweep.0b1c2d3e", team="team-a", queue="team-a",
               pod_sets=(PodSet(count=2, gpus_per_pod=8),), tolerations=(Toleration(key="gpu", operator="Exists"),))


def test_templates_get_gate_node_restriction_labels_and_resume_point() -> None:
    obj = job()
    user_affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}]}}}
    obj["spec"]["template"] = pod_template(affinity=user_affinity)
    (tmpl,) = placed_templates(JOB.pod_sets(obj), SPEC, BINDINGS, "s3://ckpt/step-10").values()
    assert tmpl["spec"]["schedulingGates"] == [{"name": n.PLACEMENT_GATE}]
    (term,) = tmpl["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "zone", "operator": "In", "values": ["z1"]},
                                        {"key": n.HOSTNAME_LABEL, "operator": "In", "values": ["gpu-1", "gpu-2"]}]
    assert tmpl["metadata"]["labels"][n.JOB_LABEL] == n.job_label(SPEC.job_id)
    assert tmpl["metadata"]["annotations"][n.RESUME_FROM_ANNOTATION] == "s3://ckpt/step-10"
    patch = JOB.run_patch(obj, {"main": tmpl})
    assert patch["spec"]["suspend"] is False and patch["spec"]["template"] is tmpl
    # a fresh start clears an earlier resume point (null deletes the key in a merge patch)
    (again,) = placed_templates(JOB.pod_sets(obj), SPEC, BINDINGS, None).values()
    assert again["metadata"]["annotations"][n.RESUME_FROM_ANNOTATION] is None


def test_each_gated_pod_gets_one_free_binding_and_loses_only_gpuqs_gate() -> None:
    assigned = assign_pods(["sweep-1-x", "sweep-0-y"], "main", BINDINGS, taken={"main-0": "sweep-9"})
    assert [(a.pod, a.binding.node) for a in assigned] == [("sweep-0-y", "gpu-2")]  # main-0 is taken already
    pod = {"spec": {"schedulingGates": [{"name": "other.io/gate"}, {"name": n.PLACEMENT_GATE}],
                    "tolerations": [{"key": "x", "operator": "Exists"}]}}
    patch = ungate_patch(pod, "gpu-2", SPEC.tolerations)
    assert patch["spec"]["nodeSelector"] == {n.HOSTNAME_LABEL: "gpu-2"}
    assert patch["spec"]["schedulingGates"] == [{"name": "other.io/gate"}]
    assert patch["spec"]["tolerations"] == [{"key": "x", "operator": "Exists"}, {"key": "gpu", "operator": "Exists"}]


def test_event_submitted_pod_template_creates_an_indexed_job() -> None:
    spec = JobSpec(job_id="pipe:train/42".replace("/", "-"), team="team-a", queue="team-a", pod_sets=(PodSet(
        count=4, gpus_per_pod=2, cpu_milli=8000, memory_mib=32768,
        template=PodTemplate(image="ghcr.io/example/train:2", command=("python", "train.py"),
                             env=(EnvVar(name="EPOCHS", value="3"),), service_account_name="trainer")),))
    pod_sets = event_pod_sets(spec)
    obj = JOB.build(n.dns_name(spec.job_id), "ml-a", pod_sets, {n.QUEUE_LABEL: "team-a"},
                    {n.JOB_ID_ANNOTATION: spec.job_id})
    assert obj["spec"]["completionMode"] == "Indexed" and obj["spec"]["completions"] == 4
    assert obj["spec"]["parallelism"] == 4 and obj["spec"]["suspend"] is True
    pod = obj["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/example/train:2" and c["command"] == ["python", "train.py"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert c["resources"]["requests"] == {"cpu": "8000m", "memory": "32768Mi"}
    assert {"name": "EPOCHS", "value": "3"} in c["env"]
    assert {"name": n.RESUME_ENV, "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['gpuq.io/resume-from']"}}} in c["env"]
    assert pod["serviceAccountName"] == "trainer"
    name = obj["metadata"]["name"]
    assert len(name) <= 52 and name.startswith("pipe-train-42-")
    several = spec.model_copy(update={"pod_sets": (*spec.pod_sets, spec.pod_sets[0].model_copy(
        update={"name": "eval"}))})
    jobset = kind_of("jobset.x-k8s.io/v1alpha2", "JobSet").build("x", "ml-a", event_pod_sets(several), {}, {})
    assert [rj["name"] for rj in jobset["spec"]["replicatedJobs"]] == ["main", "eval"]


def test_suspending_restores_the_templates_as_written() -> None:
    from services.core.kube.placement import restored_template

    obj = job()
    original = JOB.pod_sets(obj)[0].template
    placed = placed_templates(JOB.pod_sets(obj), SPEC, BINDINGS, "s3://ckpt/1")["main"]
    live = JOB.run_patch(obj, {"main": placed})["spec"]  # the object as it runs
    patch = JOB.run_patch({"spec": live}, {"main": restored_template(original)}, suspend=True)
    tmpl = patch["spec"]["template"]
    assert patch["spec"]["suspend"] is True
    assert tmpl["spec"]["schedulingGates"] == [] and tmpl["spec"]["affinity"] is None  # null deletes it
    assert tmpl["metadata"]["labels"][n.JOB_LABEL] is None and tmpl["metadata"]["labels"]["app"] == "train"
    assert tmpl["metadata"]["annotations"][n.RESUME_FROM_ANNOTATION] is None


def test_event_submitted_templates_carry_what_the_scheduler_honoured() -> None:
    affinity = NodeAffinity(required=(NodeSelectorTerm(match_expressions=(
        NodeSelectorRequirement(key="zone", operator="NotIn", values=("z9",)),)),))
    tolerate = Toleration(key="dedicated", operator="Exists")
    spec = JobSpec(job_id="ev-1", team="team-a", queue="team-a", pod_sets=(PodSet(
        gpus_per_pod=1, node_selector={"pool": "a100"}, affinity=affinity, tolerations=(tolerate,),
        template=PodTemplate(image="img", node_selector={"gen": "h"})),))
    (ps,) = event_pod_sets(spec)
    pod = ps.template["spec"]
    assert pod["nodeSelector"] == {"gen": "h", "pool": "a100"}
    assert pod["affinity"] == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["z9"]}]}]}}}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]


def test_an_event_submitted_pool_selector_is_written_as_the_nodes_pool_label() -> None:
    # admission gives a job of a queue with `pools` the selector `pool: <name>`; the nodes carry it under
    # kubernetes.pool_label (gpuq's `pool` is a copy), so the template selects that label
    spec = JobSpec(job_id="ev-2", team="team-a", queue="team-a", pod_sets=(PodSet(
        gpus_per_pod=1, node_selector={"pool": "spot", "zone": "z1"}, template=PodTemplate(image="img")),))
    (ps,) = event_pod_sets(spec, pool_label="gpuq.io/pool")
    assert ps.template["spec"]["nodeSelector"] == {"gpuq.io/pool": "spot", "zone": "z1"}
    (ps,) = event_pod_sets(spec)  # no pool label configured: the nodes carry `pool` themselves
    assert ps.template["spec"]["nodeSelector"] == {"pool": "spot", "zone": "z1"}
