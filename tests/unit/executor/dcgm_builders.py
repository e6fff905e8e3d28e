"""Builders for the DCGM core's tests: Prometheus instant-vector results as /api/v1/query returns them."""

from __future__ import annotations

from typing import Any

from services.core.executor.dcgm_series import DcgmField
from shared.domain import MigLayout, NodeSpec

T = 1_767_225_600.0


def series(labels: dict[str, str], value: float | str) -> dict[str, Any]:
    return {"metric": dict(labels), "value": [T, str(value)]}


def gpu(node: str, index: int, *, instance: int | None = None, profile: str | None = None,
        pod: tuple[str, str] | None = None, exported: bool = False, host_label: str = "Hostname",
        uuid: str | None = None) -> dict[str, str]:
    labels = {host_label: node, "gpu": str(index), "UUID": uuid or f"GPU-{node}-{index}", "device": f"nvidia{index}",
              "modelName": "NVIDIA H100 80GB HBM3"}
    if instance is not None:
        labels |= {"GPU_I_ID": str(instance), "GPU_I_PROFILE": profile or "1g.10gb"}
    if pod is not None:
        ns, name = pod
        labels |= ({"exported_namespace": ns, "exported_pod": name, "namespace": "gpu-operator",
                    "pod": "dcgm-exporter-x"} if exported else {"namespace": ns, "pod": name})
    return labels


def results(devices: list[tuple[dict[str, str], dict[DcgmField, float]]]) -> dict[DcgmField, list[dict[str, Any]]]:
    out: dict[DcgmField, list[dict[str, Any]]] = {f: [] for f in DcgmField}
    for labels, values in devices:
        for f, v in values.items():
            out[f].append(series(labels, v))
    return out


def busy(util: float, fb: float = 40_000, power: float = 500, tensor: float | None = None,
         xid: float = 0) -> dict[DcgmField, float]:
    values = {DcgmField.GR_ENGINE_ACTIVE: util, DcgmField.FB_USED: fb, DcgmField.FB_FREE: 80_000 - fb,
              DcgmField.POWER: power, DcgmField.TEMP: 60, DcgmField.XID: xid}
    if tensor is not None:
        values[DcgmField.TENSOR_ACTIVE] = tensor
    return values


def node(name: str, gpus: int = 8, mig: MigLayout | None = None, model: str = "H100-80GB") -> NodeSpec:
    return NodeSpec(name=name, gpus=gpus, gpu_model=model, cpu_milli=96000, memory_mib=1 << 20, mig=mig,
                    rack="r0", block="b0")
