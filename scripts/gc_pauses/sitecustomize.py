"""Measure every cyclic collection of each Python process started with this folder on PYTHONPATH.

    GPUQ_GC_PAUSES_DIR=/tmp/gc PYTHONPATH=scripts/gc_pauses gpuq bench e2e steady ... --layout processes
    python scripts/gc_pauses/summary.py /tmp/gc

Each process writes `<pid>.json` into GPUQ_GC_PAUSES_DIR (at most every 2 s, and after each full collection):
per generation, the count, the CPU seconds of the collecting thread, and the largest CPU and wall time of one
collection; "after": while shared/gcpolicy.py is installed (or, in a process without it, once a full collection
saw frozen objects), "before": start-up, shut-down, or a process that never freezes.
Without GPUQ_GC_PAUSES_DIR it does nothing."""

import gc
import json
import os
import sys
import time

_DIR = os.environ.get("GPUQ_GC_PAUSES_DIR")


def _service() -> str:
    argv = sys.argv
    return argv[argv.index("--services") + 1] if "--services" in argv[:-1] else os.path.basename(argv[0] or "python")


if _DIR:
    _start = [0.0, 0.0, False, False]
    _stats: dict[str, list[float]] = {}
    _written = [0.0]
    _pid = os.getpid()

    def _on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            # (gc.get_freeze_count walks the frozen list: asked only after full collections, which walk as much)
            _start[0], _start[1] = time.perf_counter(), time.thread_time()
            policy = sys.modules.get("shared.gcpolicy")
            if policy is not None:  # while the policy is installed (not after `uninstall` at shutdown)
                _start[3] = getattr(policy, "_installed", None) is not None
            return
        if os.getpid() != _pid:  # a forked child: its own file, its own figures
            return
        wall, cpu = time.perf_counter() - _start[0], time.thread_time() - _start[1]
        frozen = _start[3] if "shared.gcpolicy" in sys.modules else _start[2]
        key = f"gen{info['generation']}_{'after' if frozen else 'before'}"
        if info["generation"] == 2 and "shared.gcpolicy" not in sys.modules:
            _start[2] = gc.get_freeze_count() > 0  # for the collections after this one
        s = _stats.setdefault(key, [0, 0.0, 0.0, 0.0])
        s[0] += 1
        s[1] += cpu
        s[2] = max(s[2], cpu)
        s[3] = max(s[3], wall)
        now = time.time()
        if now - _written[0] > 2 or info["generation"] == 2:
            _written[0] = now
            with open(os.path.join(_DIR, f"{_pid}.json"), "w") as f:
                json.dump({"process": _service(), "pid": _pid, "collections": {
                    k: {"count": int(v[0]), "cpu_s": round(v[1], 3), "max_cpu_ms": round(v[2] * 1000, 1),
                        "max_wall_ms": round(v[3] * 1000, 1)} for k, v in sorted(_stats.items())}}, f)

    gc.callbacks.append(_on_collection)
