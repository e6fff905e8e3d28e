"""Quota keys beyond GPU models (docs/admission.md "Quotas beyond GPUs"), and what a configuration may write.

A queue's or cohort's `quotas` maps a key to nominal/borrowing/lending amounts. A GPU model (and `<model>:<profile>`)
is a flavor its pod sets are placed on; these keys are not: `cpu_milli` (milli-CPU of all the job's pods),
`memory_mib` (MiB of memory of all its pods), `pods` (its pods) and `pool/<name>` (the GPUs of its pod sets that
select node pool `<name>` by the node label `pool`). A key a queue does not set is not limited for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

CPU = "cpu_milli"
MEMORY = "memory_mib"
PODS = "pods"
POOL = "pool/"
POOL_LABEL = "pool"
NON_GPU = (CPU, MEMORY, PODS)

# what people write for the keys above, Kubernetes' names among them
_GUESSES = {"cpu": CPU, "cpus": CPU, "memory": MEMORY, "mem": MEMORY, "ram": MEMORY, "pod": PODS}
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def is_non_gpu(key: str) -> bool:
    """Whether a quota key is a resource beyond GPU models (never a flavor a pod set is placed on)."""
    return key in NON_GPU or key.startswith(POOL)


def is_whole_gpu(key: str) -> bool:
    """Whether a quota key counts whole GPUs of a model (not a MIG slice or share `<model>:<profile>`, not a
    resource beyond GPUs)."""
    return ":" not in key and not is_non_gpu(key)


def quota_key_problems(keys: Iterable[str]) -> list[str]:
    """What is wrong with a configuration's quota keys, one line each naming the key."""
    out = []
    for key in keys:
        if key.lower() in _GUESSES:
            out.append(f"quota key {key!r}: write {_GUESSES[key.lower()]!r} (CPU is counted in milli-CPU as "
                       f"`{CPU}`, memory in MiB as `{MEMORY}`, as a job's pod sets ask them)")
        elif key.startswith(POOL):
            if not _LABEL_VALUE.match(key[len(POOL):]):
                out.append(f"quota key {key!r}: a node-pool quota is `{POOL}<name>`, the name being a value of the "
                           f"nodes' `{POOL_LABEL}` label (letters, digits, '-', '_', '.'; at most 63)")
        elif "/" in key:
            out.append(f"quota key {key!r}: the only keys with '/' are node pools, `{POOL}<name>`")
        elif ":" in key and key.split(":", 1)[0] in NON_GPU:
            out.append(f"quota key {key!r}: {key.split(':', 1)[0]} takes no ':<profile>' suffix")
    return out


def shown(key: str, amount: int) -> str:
    """`key:amount` as `gpuq queues` prints it: CPU in cores and memory in Gi/Mi, as Kubernetes writes them."""
    if key == CPU:
        return f"cpu:{amount // 1000}" if amount % 1000 == 0 else f"cpu:{amount}m"
    if key == MEMORY:
        return f"memory:{amount // 1024}Gi" if amount % 1024 == 0 else f"memory:{amount}Mi"
    return f"{key}:{amount}"
