"""A running elastic workload resized (issue 48; docs/kubernetes.md, "Elastic workloads").

On the scheduler's JobResized the executor, the workload's one writer, records the job's new placement and
writes it into the workload in the same unit of work: its pod templates restricted to the nodes of the new
placement, its replicas (`resize_patch`: the operator creates or deletes the highest-numbered workers) and the
target-size annotations `gpuq.io/target-pods` / `gpuq.io/target-pods-by-set` on it and its templates, then the
same annotations on each live pod (`pod_notice`), which the training code reads with `gpuq_sdk.target_pods()`.
A grown job's new pods come gated, as every pod of gpuq's does, and the pod watch gives each a binding of the new
placement (its row is updated first, and the watch reads it under the same row lock).
"""

from __future__ import annotations

import json
import logging

from services.core.kube.elastic import placed_counts, pod_notice, run_elastic
from services.core.kube.kinds import kind_of
from services.core.kube.placement import placed_templates
from services.core.kube.workload import PodSetTemplate
from services.executor.kube.client import POD, KubeApi, status_code, workload_resource
from services.executor.kube.notices import Notices
from services.executor.kube.pods import PodWatch
from services.executor.kube.records import ACTIVE, bindings_of, ref_of
from shared.domain import JobSpec
from shared.events import CloudEvent, JobResized
from shared.service import Tx

log = logging.getLogger("gpuq.executor.kube")


class Resizes:
    def __init__(self, api: KubeApi, notices: Notices, pods: PodWatch):
        self.api, self.notices, self.pods = api, notices, pods

    async def on_resized(self, tx: Tx, event: CloudEvent, payload: JobResized) -> None:
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1 FOR UPDATE", payload.job_id)
        if row is None or row["state"] not in ACTIVE:
            return  # not running here (ended, or not this executor's): nothing to resize
        spec = JobSpec.model_validate_json(row["spec"])
        kind = kind_of(row["api_version"], row["kind"])
        if not spec.elastic or kind is None:
            return
        before = len(bindings_of(row))
        await tx.conn.execute("UPDATE executor.kube_jobs SET placement = $2 WHERE job_id = $1", payload.job_id,
                              json.dumps([b.model_dump(mode="json") for b in payload.bindings]))
        res = workload_resource(kind)
        try:
            obj = await self.api.get(res, row["name"], namespace=row["namespace"])
        except Exception as exc:
            if status_code(exc) == 404:
                log.info("%s: its workload is gone; the resize is not written", payload.job_id)
                return
            raise
        originals = [PodSetTemplate(name, 0, tmpl) for name, tmpl in json.loads(row["templates"]).items()]
        templates = placed_templates(originals, spec, payload.bindings, row["resume_from"])
        await self.api.patch(res, row["name"], run_elastic(kind, obj, spec, payload.bindings, templates),
                             namespace=row["namespace"])
        counts = placed_counts(spec, payload.bindings)
        for pod in self.pods.job_pods(row):
            await self.api.patch(POD, pod["metadata"]["name"], pod_notice(spec, counts), namespace=row["namespace"])
        how = "grown" if payload.pods > before else "shrunk" if payload.pods < before else "kept"
        why = f" to make room for {payload.for_job}" if payload.for_job else ""
        await self.notices.event(ref_of(row), "Resized", f"{how} from {before} to {payload.pods} pods{why} "
                                 f"({', '.join(f'{k}={v}' for k, v in sorted(counts.items()))})", tx.now)


__all__ = ["Resizes"]
