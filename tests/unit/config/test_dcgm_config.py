"""The DCGM source's settings (cluster.yaml `dcgm`, GPUQ_DCGM_* variables) and the peaks behind MFU."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from shared.config import APPLICATION_XIDS, ConfigError, GpuFlavor, dcgm_settings, parse_cluster, parse_queues
from shared.domain import Precision
from shared.events import JobFlopsReported, parse_event
from shared.mfu import flops_event, flops_report, mfu, peak_tflops

GROUP = {"name": "h100", "count": 1, "gpus_per_node": 8, "gpu_model": "H100-80GB", "cpu_milli": 1000,
         "memory_mib": 1024}


def cluster(**dcgm: object) -> dict[str, object]:
    return {"node_groups": [GROUP], "dcgm": dcgm}


def test_the_section_is_optional_and_defaults_are_the_documented_ones() -> None:
    assert parse_cluster({"node_groups": [GROUP]}).dcgm is None
    assert dcgm_settings(parse_cluster({"node_groups": [GROUP]}), {}) is None  # the synthetic samples stay
    s = parse_cluster(cluster(prometheus_url="http://prometheus.monitoring:9090/")).dcgm
    assert s is not None and s.prometheus_url == "http://prometheus.monitoring:9090"
    assert (s.interval_s, s.window_s, s.timeout_s) == (15.0, 30.0, 10.0)
    assert s.labels.node == ("Hostname", "hostname") and s.ignore_xids == APPLICATION_XIDS
    assert [(p.namespace, p.pod) for p in s.labels.pods] == [("exported_namespace", "exported_pod"),
                                                            ("namespace", "pod")]


@pytest.mark.parametrize(("dcgm", "fragment"), [
    ({}, "dcgm.prometheus_url: Field required"),
    ({"prometheus_url": "prometheus:9090"}, "not an http(s) URL of a Prometheus server"),
    ({"prometheus_url": "http://p", "interval_s": 0.5}, "dcgm.interval_s: Input should be greater than or equal to 1"),
    ({"prometheus_url": "http://p", "interval_s": 5, "timeout_s": 10}, "timeout_s (10.0) must not exceed interval_s"),
    ({"prometheus_url": "http://p", "selector": "job=dcgm"}, "not a list of PromQL label matchers"),
    ({"prometheus_url": "http://p", "labels": {"node": ["Host-name"]}}, "not valid Prometheus label names: Host-name"),
    ({"prometheus_url": "http://p", "missing_gpu_polls": 0}, "dcgm.missing_gpu_polls"),
    ({"prometheus_url": "http://p", "bogus": 1}, "dcgm.bogus: Extra inputs are not permitted"),
])
def test_bad_settings_name_the_path_and_the_problem(dcgm: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cluster(cluster(**dcgm), "cluster.yaml")
    assert fragment in str(err.value) and "cluster.yaml" in str(err.value)


def test_selectors_accept_promql_matchers() -> None:
    s = parse_cluster(cluster(prometheus_url="http://p", selector='{job="dcgm-exporter", cluster=~"a|b",}')).dcgm
    assert s is not None and s.selector == 'job="dcgm-exporter", cluster=~"a|b"'


def test_the_environment_enables_and_overrides_with_errors_naming_the_variable() -> None:
    s = dcgm_settings(None, {"GPUQ_DCGM_PROMETHEUS_URL": "https://prom.example:9090", "GPUQ_DCGM_INTERVAL_S": "30"})
    assert s is not None and (s.prometheus_url, s.interval_s) == ("https://prom.example:9090", 30.0)
    base = parse_cluster(cluster(prometheus_url="http://p", selector='job="dcgm"'))
    s = dcgm_settings(base, {"GPUQ_DCGM_PROMETHEUS_URL": "http://other:9090"})
    assert s is not None and s.prometheus_url == "http://other:9090" and s.selector == 'job="dcgm"'
    with pytest.raises(ConfigError, match="GPUQ_DCGM_INTERVAL_S: Input should be a valid number"):
        dcgm_settings(base, {"GPUQ_DCGM_INTERVAL_S": "often"})
    with pytest.raises(ConfigError, match="GPUQ_DCGM_PROMETHEUS_URL: 'ftp://x' is not an http"):
        dcgm_settings(None, {"GPUQ_DCGM_PROMETHEUS_URL": "ftp://x"})
    with pytest.raises(ConfigError, match="set GPUQ_DCGM_PROMETHEUS_URL"):
        dcgm_settings(None, {"GPUQ_DCGM_INTERVAL_S": "30"})


def test_peaks_are_per_precision_and_positive() -> None:
    q = parse_queues({"priority_classes": [{"name": "normal", "value": 1}], "queues": [{"name": "a"}],
                      "gpu_flavors": {"H100": {"peak_tflops": {"bf16": 989, "fp8": 1979}}}})
    assert q.flavor("H100").peak_tflops == {Precision.BF16: 989.0, Precision.FP8: 1979.0}
    with pytest.raises(ConfigError, match=r"gpu_flavors\.H100\.peak_tflops"):
        parse_queues({"priority_classes": [{"name": "normal", "value": 1}], "queues": [{"name": "a"}],
                      "gpu_flavors": {"H100": {"peak_tflops": {"bf17": 1}}}})
    with pytest.raises(ConfigError, match="positive and finite"):
        parse_queues({"priority_classes": [{"name": "normal", "value": 1}], "queues": [{"name": "a"}],
                      "gpu_flavors": {"H100": {"peak_tflops": {"bf16": 0}}}})


def test_mfu_is_achieved_over_the_peak_of_the_gpus_held() -> None:
    flavors = {"H100": GpuFlavor(peak_tflops={Precision.BF16: 1000.0}), "L4": GpuFlavor()}
    # 8 whole H100s and one 1g slice (1/7 of a GPU, 142 milli-GPUs).
    peak = peak_tflops([("H100", 8000), ("H100", 142)], Precision.BF16, flavors)
    assert peak == pytest.approx(8142.0)
    assert mfu(4071.0, peak) == pytest.approx(0.5)
    assert peak_tflops([("H100", 1000)], Precision.FP8, flavors) is None  # no peak at that precision
    assert peak_tflops([("L4", 1000)], Precision.BF16, flavors) is None  # no peak for that model
    assert mfu(1.0, None) is None


def test_the_job_side_helper_builds_a_valid_event() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    assert flops_report("j1", 2.5e15, "bf16", at=at, step=100).achieved_tflops == pytest.approx(2500.0)
    event = flops_event("j1", 2.5e15, Precision.BF16, at=at, source="pod/j1-main-0")
    _, payload = parse_event(event.model_dump(mode="json"))
    assert isinstance(payload, JobFlopsReported) and payload.precision is Precision.BF16
    assert event.subject == "j1" and JobFlopsReported.subject().endswith(".utilization.flops_reported")
    with pytest.raises(ValueError, match="positive finite"):
        flops_report("j1", float("nan"), "bf16", at=at)
    with pytest.raises(ValueError, match="unknown precision 'bf17'"):
        flops_report("j1", 1e15, "bf17", at=at)


def test_the_kubernetes_executor_runs_the_source_from_cluster_yaml_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.stack import StackSettings, build_specs

    kubeconfig = tmp_path / "kubeconfig"  # read, never contacted: building the service makes no request
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    queues = parse_queues({"priority_classes": [{"name": "normal", "value": 1}], "queues": [{"name": "a"}]})

    def loops(cluster: dict[str, object]) -> list[str]:
        settings = StackSettings(nats_url="nats://127.0.0.1:1", database_url="postgresql://127.0.0.1:1/x",
                                 queues=queues, cluster=parse_cluster(cluster), services=("executor",),
                                 executor="kube", kubeconfig=kubeconfig)
        (spec,) = build_specs(settings)
        return [loop.__name__ for loop in spec.background]

    monkeypatch.delenv("GPUQ_DCGM_PROMETHEUS_URL", raising=False)
    assert "poll_gpus" not in loops({"source": "kubernetes"})  # no setting: no source
    assert "poll_gpus" in loops({"source": "kubernetes", "dcgm": {"prometheus_url": "http://prometheus:9090"}})
    monkeypatch.setenv("GPUQ_DCGM_PROMETHEUS_URL", "http://prometheus.monitoring:9090")
    assert "poll_gpus" in loops({"source": "kubernetes"})
