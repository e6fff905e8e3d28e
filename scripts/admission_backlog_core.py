"""The admission core under `gpuq bench e2e steady`'s backlog: 20 team queues (400 GPUs of nominal quota each) and
a `waiting` queue (1 GPU, no borrowing) in one cohort, WAITING jobs held in the latter, then cycles that each see
PER_CYCLE arrivals in the team queues (the oldest of 500 running jobs ending as new ones are admitted). Prints the
CPU of one cycle and of the walk of its judged statuses (`PendingStatuses.judged_rows`, as the service does).

    python scripts/admission_backlog_core.py [WAITING=10000] [PER_CYCLE=3] [CYCLES=300]
"""
import sys
import time

from services.core.admission import AdmissionState, Workload, admission_cycle
from services.core.admission.statuses import PendingStatuses
from shared.config import parse_queues
from shared.domain import JobSpec, PodSet

waiting = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
per_cycle = int(sys.argv[2]) if len(sys.argv) > 2 else 3
cycles = int(sys.argv[3]) if len(sys.argv) > 3 else 300
queues = 20
cfg = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}], "cohorts": [{"name": "bench"}],
    "queues": [{"name": f"team-{i:02d}", "cohort": "bench", "quotas": {"H100-80GB": {"nominal": 400}}}
               for i in range(queues)]
    + [{"name": "waiting", "cohort": "bench", "quotas": {"H100-80GB": {"nominal": 1, "borrowing_limit": 0}}}]}, "<b>")
state = AdmissionState(cfg)
one_gpu = (PodSet(count=1, gpus_per_pod=1, gpu_models=("H100-80GB",)),)
for i in range(waiting):
    state.submit(Workload(JobSpec(job_id=f"wait-{i:06d}", team="waiting", queue="waiting", pod_sets=one_gpu), 0.0))


def walk(pending: object) -> int:
    assert isinstance(pending, PendingStatuses)  # what admission_cycle returns
    return len(list(pending.judged_rows()))


walk(admission_cycle(state, 0.0).pending)
now, n = 1.0, 0
running: list[str] = []
t_cycle = t_rows = 0.0
rows = 0
for _ in range(cycles):
    for _ in range(per_cycle):
        q = f"team-{n % queues:02d}"
        state.submit(Workload(JobSpec(job_id=f"j-{n:06d}", team=q, queue=q, pod_sets=one_gpu), now))
        n += 1
    while len(running) > 500:
        state.finish(running.pop(0))
    now += 0.03
    t0 = time.process_time()
    d = admission_cycle(state, now)
    t1 = time.process_time()
    rows += walk(d.pending)
    t2 = time.process_time()
    t_cycle += t1 - t0
    t_rows += t2 - t1
    running += [a.job_id for a in d.admitted]
print(f"waiting {waiting}, {per_cycle} arrivals per cycle, {cycles} cycles: cycle {t_cycle / cycles * 1000:.2f} ms, "
      f"statuses walk {t_rows / cycles * 1000:.2f} ms, rows walked per cycle {rows / cycles:.0f}")
