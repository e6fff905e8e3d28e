"""Prometheus metrics through the OpenTelemetry SDK and its Prometheus exporter.

Histograms are fed with the core's `Observation`s as events arrive. Counters are summed here, per series, as
they arrive (a dict add) and exposed as observable counters whose callbacks read those totals at scrape time:
an SDK counter's `add` (attribute cleaning and hashing per call) was most of a utilisation sample's CPU, and
samples add two per series and node every interval. Gauges are observable instruments whose callbacks read one
snapshot of the core (`TelemetryState.gauges(now)`), taken once per scrape. The exporter writes into a registry
of our own (not prometheus_client's global one) so several instances can live in one process (tests) and
`/metrics` shows only gpuq's series."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, ObservableCounter, ObservableGauge
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from services.core.telemetry.names import COUNTER, GAUGE, HISTOGRAM, JCT_BUCKETS_S, METRICS, WAIT_BUCKETS_S
from services.core.telemetry.state import Gauges
from services.core.telemetry.state import Labels as CoreLabels
from services.core.telemetry.state import Observation as CoreObservation
from shared.settings import settings

DEFAULT_PORT = 9464
# Whether the per-job gauges (`gpuq_job_*`, labelled with job ids) are exported: off by default, since whoever can
# scrape /metrics would read every team's job ids from them (docs/observability.md).
JOB_LABELS_ENV = "GPUQ_METRICS_JOB_LABELS"
_BUCKETS = {"gpuq_admission_wait_seconds": WAIT_BUCKETS_S, "gpuq_job_completion_seconds": JCT_BUCKETS_S}
# Per-GPU series of a large cluster exceed the SDK's default of 2000 points per instrument.
# Keys are instrument classes; the SDK's own alias for this mapping is internal, hence Any.
_CARDINALITY: dict[Any, int] = {Counter: 50_000, ObservableCounter: 50_000, Histogram: 20_000,
                                ObservableGauge: 200_000}


def job_labels_from_env(env: Mapping[str, str] = os.environ) -> bool:
    return settings(env).metrics_job_labels


class _SnapshotRefresher:
    """Registered before the exporter's collector, so each scrape takes exactly one fresh snapshot
    (prometheus_client calls collectors in registration order) that every gauge callback then reads."""

    def __init__(self, refresh: Callable[[], None]):
        self._refresh = refresh

    def collect(self) -> Iterable[Any]:
        self._refresh()
        return []


class TelemetryMetrics:
    def __init__(self, snapshot: Callable[[], Gauges], service_name: str = "gpuq-telemetry"):
        self._snapshot_fn = snapshot
        self._snapshot: Gauges = {}
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotRefresher(self.refresh))
        self.reader = PrometheusMetricReader(scope_info_enabled=False, registry=self.registry,
                                             cardinality_limits=_CARDINALITY)
        views = [View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(list(buckets)))
                 for name, buckets in _BUCKETS.items()]
        self.provider = MeterProvider(metric_readers=[self.reader], views=views,
                                      resource=Resource.create({"service.name": service_name}))
        meter = self.provider.get_meter("gpuq.telemetry")
        # counter -> series -> total since start (what a scrape reports; restarts from zero like an SDK counter)
        self._totals: dict[str, dict[CoreLabels, float]] = {}
        self._histograms: dict[str, Any] = {}
        for name, d in sorted(METRICS.items()):
            if d.kind == COUNTER:
                self._totals[name] = {}
                meter.create_observable_counter(name, callbacks=[self._counter_callback(name)], unit=d.unit,
                                                description=d.help)
            elif d.kind == HISTOGRAM:
                self._histograms[name] = meter.create_histogram(name, unit=d.unit, description=d.help)
            elif d.kind == GAUGE:
                meter.create_observable_gauge(name, callbacks=[self._gauge_callback(name)], unit=d.unit,
                                              description=d.help)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        snap = self._snapshot_fn()
        with self._lock:
            self._snapshot = snap

    def _gauge_callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                series = self._snapshot.get(name, {})
            return [Observation(value, dict(lbls)) for lbls, value in series.items()]

        return callback

    def _counter_callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        totals = self._totals[name]

        def callback(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                series = sorted(totals.items())
            return [Observation(value, dict(lbls)) for lbls, value in series]

        return callback

    def record(self, observations: Iterable[CoreObservation]) -> None:
        histograms = []
        with self._lock:  # a scrape's callbacks read the totals from the HTTP thread
            for o in observations:
                if o.kind == "counter":
                    if o.value > 0:  # a counter only grows (the SDK's counter refused negative adds too)
                        totals = self._totals[o.name]
                        totals[o.labels] = totals.get(o.labels, 0.0) + o.value
                else:
                    histograms.append(o)
        # Outside the lock: the SDK takes its own locks, and a scrape holds those while calling our callbacks.
        for o in histograms:
            self._histograms[o.name].record(o.value, dict(o.labels))

    def render(self) -> bytes:
        """The /metrics body (what a scrape returns)."""
        return generate_latest(self.registry)

    def serve(self, port: int = DEFAULT_PORT, addr: str = "0.0.0.0") -> int:
        """Start the `/metrics` HTTP endpoint in a daemon thread; returns the bound port."""
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(self._server.server_port)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.provider.shutdown()
