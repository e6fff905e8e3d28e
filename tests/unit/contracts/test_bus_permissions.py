"""Each service's bus user is granted exactly the JetStream consumers and streams the service uses
(shared/natsauth.py): its durables are the ones its handlers' consumer plan creates, its streams the ones it
publishes to or consumes, and only a stream's owner may update it. (tests/service/security/test_bus_permissions.py
proves the grants on a real nats-server.)"""

from __future__ import annotations

from typing import Any

import pytest

from services.admission.sharding import Shard
from services.executor.kube.app import KubeExecutor, KubeExecutorSettings
from services.stack import ALL_SERVICES, StackSettings, build_specs
from shared import namespace
from shared.bus import consumer_plan, streams
from shared.config import ClusterConfig, ClusterSource, parse_cluster, parse_queues
from shared.natsauth import ADMIN, ANY_ADMISSION_SHARD, KUBE, SERVICES, durables, permissions, stream_rights
from shared.service import ServiceSpec

NS = namespace.current()  # the consumer plans are this process's namespace's
QUEUES = parse_queues({"priority_classes": [{"name": "normal", "value": 1}],
                       "queues": [{"name": "q", "quotas": {"H100": {"nominal": 8}}}]})
CLUSTER = parse_cluster({"node_groups": [{"name": "h", "count": 1, "gpus_per_node": 8, "gpu_model": "H100",
                                          "cpu_milli": 1000, "memory_mib": 1000}]}, "test")


def specs() -> dict[str, ServiceSpec]:
    settings = StackSettings(nats_url="nats://x", database_url="postgresql://x", queues=QUEUES, cluster=CLUSTER,
                             services=ALL_SERVICES, admission_cohorts=())
    return {s.name: s for s in build_specs(settings)}


def plan_durables(spec: ServiceSpec) -> set[tuple[str, str]]:
    return {(p.stream.name, f"{spec.name}{spec.consumer_suffix}-{p.suffix}")
            for p in consumer_plan([*spec.handlers, *spec.batch_handlers])}


def granted_durables(user: str, suffixes: tuple[str, ...] = ()) -> set[tuple[str, str]]:
    return {(s.name, d) for s in streams(NS) for d in durables(user, NS, s, suffixes)}


def test_every_service_is_granted_exactly_the_durables_it_creates() -> None:
    built = specs()
    assert set(built) == set(SERVICES)
    for name, spec in built.items():
        assert granted_durables(name) == plan_durables(spec), name


def test_the_kubernetes_executor_reads_as_the_executor() -> None:
    kube = KubeExecutor(KubeExecutorSettings(cluster=ClusterConfig(source=ClusterSource.KUBERNETES), queues=QUEUES),
                        api=None)  # type: ignore[arg-type]  # only its handlers are read
    assert granted_durables(KUBE) == plan_durables(kube.spec())


def test_a_per_cohort_admission_instance_needs_its_suffix_granted() -> None:
    settings = StackSettings(nats_url="nats://x", database_url="postgresql://x", queues=QUEUES,
                             services=("admission",), admission_cohorts=("research", "-"))
    spec = build_specs(settings)[0]
    suffix = Shard.of(("research", "-")).consumer_suffix
    assert not plan_durables(spec) <= granted_durables("admission")
    assert plan_durables(spec) <= granted_durables("admission", (suffix,))
    # A development server (`gpuq up`'s embedded one) lets admission use any consumer of its streams, for instances
    # of some cohorts that join it later; no other user gets a wildcard there.
    wild = [s for s in permissions("admission", NS, admission_suffixes=(ANY_ADMISSION_SHARD,)).publish if "*" in s]
    assert wild and all(s.split(".")[-1] in ("*", ">") for s in wild)


def _js_api(user: str) -> list[str]:
    return [s for s in permissions(user, NS).publish if s.startswith("$JS")]


@pytest.mark.parametrize("user", [*SERVICES, KUBE])
def test_no_service_may_touch_another_services_consumer_or_an_unowned_stream(user: str) -> None:
    granted = _js_api(user)
    own = {d for _, d in granted_durables(user)}
    for subject in granted:
        if ".CONSUMER." in subject or subject.startswith("$JS.ACK."):
            tokens = subject.split(".")
            named = [i for i, token in enumerate(tokens) if token in own]
            assert named, subject  # names one of its own durables ...
            assert "*" not in tokens and ">" not in tokens[:named[0]], subject  # ... and no wildcard before it
    for verb in ("DELETE", "PURGE", "MSG.GET", "MSG.DELETE", "CONSUMER.DELETE", "STREAM.LIST", "STREAM.NAMES"):
        assert not any(f".{verb}." in s or s.endswith(f".{verb}") for s in granted), (user, verb)
    updates = {s.removeprefix("$JS.API.STREAM.UPDATE.") for s in granted if ".STREAM.UPDATE." in s}
    role = "executor" if user == KUBE else user
    assert updates == {s.name for s in streams(NS) if s.owner == role}, user


def test_telemetry_updates_no_stream_and_every_stream_has_one_owning_service() -> None:
    assert not [s for s in _js_api("telemetry") if ".STREAM.UPDATE." in s]
    for stream in streams(NS):
        assert stream.owner in SERVICES, stream.name
        assert stream_rights(stream.owner, NS, stream) == "update"
        assert stream_rights(ADMIN, NS, stream) == stream_rights(None, NS, stream) == "update"
        assert stream_rights("producer-team-a", NS, stream) is None


def test_every_stream_is_bounded_and_fact_streams_refuse_rather_than_drop() -> None:
    from nats.js.api import DiscardPolicy

    by_suffix: dict[str, Any] = {s.name.rsplit("_", 1)[1]: s for s in streams(NS)}
    for stream in by_suffix.values():
        assert stream.max_bytes > 0 and stream.max_age_s > 0, stream.name
    assert {n for n, s in by_suffix.items() if s.discard == DiscardPolicy.NEW} == {"JOBS", "PREEMPTION", "CLUSTER"}


def test_gpuq_nats_auth_grants_the_named_admission_instances_their_consumers(tmp_path: Any) -> None:
    import yaml
    from typer.testing import CliRunner

    from cli.main import app

    queues = tmp_path / "queues.yaml"
    queues.write_text(yaml.safe_dump({"priority_classes": [{"name": "normal", "value": 1}],
                                      "cohorts": [{"name": "research"}],
                                      "queues": [{"name": "q", "cohort": "research",
                                                  "quotas": {"H100": {"nominal": 8}}}]}))
    res = CliRunner().invoke(app, ["nats-auth", "--queues", str(queues), "--out", str(tmp_path / "auth"),
                                   "--bcrypt-cost", "4", "--namespace", "prod", "--admission-cohorts", "research, -"])
    assert res.exit_code == 0, res.output
    conf = (tmp_path / "auth" / "nats-auth.conf").read_text()
    suffix = Shard.of(("research", "-")).consumer_suffix
    assert f'"$JS.API.CONSUMER.MSG.NEXT.PROD_JOBS.admission{suffix}-job"' in conf
    assert '"$JS.API.CONSUMER.MSG.NEXT.PROD_JOBS.admission-job"' in conf


def test_stream_byte_limits_are_set_per_stream_and_refused_when_malformed() -> None:
    from shared.bus import _STREAM_SHAPES, GIB, MIB, byte_limits

    assert byte_limits("JOBS=64Gi, audit=8G,STATUS=1024,DLQ=2MiB") == {
        "JOBS": 64 * GIB, "AUDIT": 8 * 1000**3, "STATUS": 1024, "DLQ": 2 * MIB}
    for bad in ("JOBZ=1Gi", "JOBS=1.5Gi", "JOBS=", "JOBS=0", "JOBS=12Pi"):
        with pytest.raises(ValueError, match="GPUQ_STREAM_MAX_BYTES"):
            byte_limits(bad)
    # The defaults reserve no more of the server's store than before every stream was bounded (12 GiB).
    assert sum(s.max_bytes for s in _STREAM_SHAPES) == 12 * GIB
