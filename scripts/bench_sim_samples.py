"""CPU of one round of the simulated executor's samples (1,000 busy nodes x 8 GPUs): building them with one
GpuSample validation per GPU (as before) against one validation per node's payload (`sample_payloads`).

    .venv/bin/python scripts/bench_sim_samples.py
"""
import time

from services.executor.sim import jitter, sample_payloads
from shared.events import GpuSample, UtilizationSampled, utcnow_from

NOW = 1_767_225_600.0
runs = [(f"j{i:05d}", 1, [f"n{i // 8:04d}"]) for i in range(8000)]
specs = {(j, a): (70.0, 1) for j, a, _ in runs}
models = {f"n{i:04d}": "H100" for i in range(1000)}
def old(runs, specs, models, now, interval):
    per_node = {}
    for job_id, attempt, nodes in sorted(runs, key=lambda r: r[0]):
        util, total_gpus = specs[(job_id, attempt)]
        for node in nodes:
            samples = per_node.setdefault(node, [])
            for gpu in range(max(1, total_gpus // max(1, len(nodes)))):
                value = min(100.0, max(0.0, util + jitter(job_id, gpu, now)))
                samples.append(GpuSample(job_id=job_id, gpu_index=len(samples), utilization_pct=value,
                                         memory_used_mib=int(value * 600), power_w=round(80 + 6 * value, 1)))
    return [UtilizationSampled(node=node, gpu_model=models[node], sampled_at=utcnow_from(now), interval_s=interval,
                               samples=tuple(per_node[node]), source="sim") for node in sorted(per_node)]
assert old(runs, specs, models, NOW, 1.0) == sample_payloads(runs, specs, models, NOW, 1.0)
for name, f in (("per GPU (before)", old), ("per node (after)", sample_payloads)) * 3:
    t = time.process_time()
    for k in range(30):
        f(runs, specs, models, NOW + k, 1.0)
    print(f"{name}: {(time.process_time() - t) / 30 * 1e3:.1f} ms CPU per round of 1,000 nodes x 8 GPUs")
