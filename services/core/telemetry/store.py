"""The records the telemetry core keeps (jobs, nodes, samples, utilisation sources) and the queue configuration
it prices and weighs them with: how the shell persists them (`*_json`, `*_doc`) and rebuilds them after a restart
(`load_*`), and the lookups that both the event folding and the gauges read. Pure: no I/O, no clock reads."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from services.core.telemetry.names import JOB_SERIES_CAP
from services.core.telemetry.records import DEFAULT_POOL, UNKNOWN, JobRecord, NodeRecord, NodeSample, SourceRecord
from shared.config import GpuFlavor, QueuesConfig
from shared.domain import Precision
from shared.mfu import peak_tflops
from shared.quota_keys import is_non_gpu


class TelemetryRecords:
    """The records and the queue configuration; `TelemetryState` folds events into them."""

    def __init__(self, job_series_cap: int = JOB_SERIES_CAP):
        self.jobs: dict[str, JobRecord] = {}
        self.nodes: dict[str, NodeRecord] = {}
        self.samples: dict[str, NodeSample] = {}
        self.guaranteed: dict[str, int] = {}  # gpu model -> sum of nominal quotas
        self.guaranteed_other: dict[str, int] = {}  # cpu_milli, memory_mib, pods, pool/<name> -> sum of nominal
        self.prices: dict[str, float] = {}  # gpu model -> cost per GPU-hour
        self.flavors: dict[str, GpuFlavor] = {}  # gpu model -> flavor (peak TFLOP/s for MFU)
        self.sources: dict[str, SourceRecord] = {}  # utilisation source -> its latest poll
        self.job_series_cap = job_series_cap

    # ------------------------------------------------------------------ configuration and rebuild

    def set_queues(self, config: QueuesConfig) -> None:
        guaranteed: dict[str, int] = defaultdict(int)
        for q in config.queues:
            for model, quota in q.quotas.items():
                guaranteed[model] += quota.nominal
        self.guaranteed = {k: n for k, n in sorted(guaranteed.items()) if not is_non_gpu(k)}
        self.guaranteed_other = {k: n for k, n in sorted(guaranteed.items()) if is_non_gpu(k)}
        self.prices = {m: f.cost_per_gpu_hour for m, f in sorted(config.gpu_flavors.items())}
        self.flavors = dict(sorted(config.gpu_flavors.items()))

    def load_job(self, doc: dict[str, Any]) -> None:
        rec = JobRecord.model_validate(doc)
        self.jobs[rec.job_id] = rec

    def load_node(self, doc: dict[str, Any]) -> None:
        rec = NodeRecord.model_validate(doc)
        self.nodes[rec.node.name] = rec

    def load_sample(self, doc: dict[str, Any]) -> None:
        rec = NodeSample.model_validate(doc)
        self.samples[rec.node] = rec

    def load_source(self, doc: dict[str, Any]) -> None:
        rec = SourceRecord.model_validate(doc)
        self.sources[rec.source] = rec

    def source_doc(self, name: str) -> dict[str, Any] | None:
        rec = self.sources.get(name)
        return rec.model_dump(mode="json") if rec is not None else None

    # The records as JSON text, encoded by pydantic's serializer in one step (what the shell persists).
    def job_json(self, job_id: str) -> str | None:
        """A job's record without the fields at their defaults (the spec's included): a quarter of the full
        document's size for a typical job, which is what Postgres parses and writes again at each of the job's
        events; `load_job` gives the same record back (the defaults fill in)."""
        rec = self.jobs.get(job_id)
        return rec.model_dump_json(exclude_defaults=True) if rec is not None else None

    def sample_json(self, name: str) -> str | None:
        rec = self.samples.get(name)
        return rec.model_dump_json() if rec is not None else None

    def source_json(self, name: str) -> str | None:
        rec = self.sources.get(name)
        return rec.model_dump_json() if rec is not None else None

    def job_doc(self, job_id: str) -> dict[str, Any] | None:
        rec = self.jobs.get(job_id)
        return rec.model_dump(mode="json") if rec is not None else None

    def node_doc(self, name: str) -> dict[str, Any] | None:
        rec = self.nodes.get(name)
        return rec.model_dump(mode="json") if rec is not None else None

    def sample_doc(self, name: str) -> dict[str, Any] | None:
        rec = self.samples.get(name)
        return rec.model_dump(mode="json") if rec is not None else None


    # ------------------------------------------------------------------ lookups

    def node_labels(self, name: str, fallback_model: str | None = None) -> tuple[str, str]:
        rec = self.nodes.get(name)
        if rec is None:
            return DEFAULT_POOL, fallback_model or UNKNOWN
        return rec.pool, rec.node.gpu_model

    def peak(self, rec: JobRecord, precision: Precision) -> float | None:
        return peak_tflops([(self.node_labels(node)[1], milli) for node, milli in rec.shares], precision,
                           self.flavors)


__all__ = ["TelemetryRecords"]
