"""The admission core's share of `gpuq bench e2e burst`: the burst's queues (20 in one cohort, 8,000 GPUs of
nominal quota), its 1-GPU jobs submitted in batches, one admission cycle per batch and a walk of the statuses it
judged, as the service does. Prints the CPU of each part.

    python scripts/admission_burst_core.py [JOBS=20000] [BATCH=256]
"""
import sys
import time

from services.core.admission import AdmissionState, Workload, admission_cycle
from shared.config import parse_queues
from shared.domain import JobSpec, PodSet

jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 256
queues = 20
per_queue = 8000 // queues
cfg = parse_queues({"priority_classes": [{"name": "normal", "value": 100}], "cohorts": [{"name": "bench"}],
                    "queues": [{"name": f"team-{i:02d}", "cohort": "bench",
                                "quotas": {"H100-80GB": {"nominal": per_queue}}} for i in range(queues)]}, "<b>")
state = AdmissionState(cfg)
t_cycle = t_rows = 0.0
admitted = 0
now = 0.0
for start in range(0, jobs, batch):
    for n in range(start, min(jobs, start + batch)):
        q = f"team-{n % queues:02d}"
        state.submit(Workload(JobSpec(job_id=f"j-{n:06d}", team=q, queue=q,
                                      pod_sets=(PodSet(count=1, gpus_per_pod=1, gpu_models=("H100-80GB",)),)), now))
    now += 0.01
    t0 = time.process_time()
    d = admission_cycle(state, now)
    t1 = time.process_time()
    rows = sum(1 for _ in d.pending.judged_rows())
    t2 = time.process_time()
    t_cycle += t1 - t0
    t_rows += t2 - t1
    admitted += len(d.admitted)
print(f"jobs {jobs} batch {batch}: admitted {admitted}, pending {len(state.pending)}, "
      f"cycle CPU {t_cycle:.2f} s, judged rows CPU {t_rows:.2f} s, last rows {rows}")
