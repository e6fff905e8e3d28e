"""What a proposed queue configuration changes, and the mistakes it would make against the live cluster.

Pure: the caller reads the version in force, the nodes the executors announced (the scheduler's read model) and the
jobs each queue holds, and passes them in. `gpuq apply-queues --dry-run` prints the result; `gpuq apply-queues`,
the API and admission (the configuration's owner, whatever path the change came by) refuse a change with
`refusals` unless it is forced.

Refused (unless forced), because each is almost certainly a typo or a slip, and each silently corrupts admission:
- a guarantee (the sum of nominal quotas of a GPU model: queues' and cohorts' own) above the GPUs of that model the
  cluster has, when the change raises it (admission would admit against quota that does not exist);
- a quota for a GPU model the cluster does not have, new in this change;
- the same two for quotas beyond GPUs: `cpu_milli` and `memory_mib` against the nodes' CPU and memory, `pool/<name>`
  against the GPUs of nodes labelled `pool: <name>` (a pool no node carries is refused when new); `pods` is not
  checked (no node announces a pod limit);
- removing a queue that still holds pending or admitted jobs.
Only what the change makes worse is refused: a cluster that lost nodes since the version in force was applied must
not block an unrelated change (that is a warning). With no node announced yet (a first start, before any executor
ran) capacity cannot be judged: those checks are warnings, never refusals, so an install can apply its queues first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.core.admission.resources import base_model
from shared.config import FlavorQuota, QueuesConfig
from shared.domain import NodeSpec
from shared.quota_keys import CPU, MEMORY, POOL, POOL_LABEL, is_non_gpu


@dataclass(frozen=True)
class Inventory:
    """The GPUs the cluster has, from the nodes the executors announced (not removed; any health: a node being
    repaired still counts toward what the platform team bought)."""

    gpus: Mapping[str, int] = field(default_factory=dict)  # GPUs per model (MIG-partitioned ones included)
    slices: Mapping[str, int] = field(default_factory=dict)  # MIG slices per `model:profile`, shares (gpu-share)
    nodes: int = 0
    # beyond GPUs: milli-CPU (`cpu_milli`), MiB of memory (`memory_mib`) and GPUs per node pool (`pool/<name>`)
    others: Mapping[str, int] = field(default_factory=dict)

    @property
    def known(self) -> bool:
        return self.nodes > 0

    def models(self) -> set[str]:
        return set(self.gpus) | {base_model(k) for k in self.slices}

    def capacity(self, resource: str) -> int | None:
        """What the cluster has of a quota key; None when it cannot tell (a MIG key with no node of that layout)."""
        if ":" in resource:
            return self.slices.get(resource)
        if is_non_gpu(resource):
            return self.others.get(resource, 0) if resource in self.others or resource.startswith(POOL) else None
        return self.gpus.get(resource, 0)

    def text(self) -> str:
        parts = [f"{n} {m}" for m, n in sorted(self.gpus.items())]
        parts += [f"{n} {k} slices" for k, n in sorted(self.slices.items())]
        return ", ".join(parts) or "no GPUs"


def inventory_of(nodes: Iterable[NodeSpec]) -> Inventory:
    gpus: dict[str, int] = {}
    slices: dict[str, int] = {}
    others: dict[str, int] = {}
    count = 0
    for n in nodes:
        count += 1
        others[CPU] = others.get(CPU, 0) + n.cpu_milli
        others[MEMORY] = others.get(MEMORY, 0) + n.memory_mib
        if POOL_LABEL in n.labels:
            key = POOL + n.labels[POOL_LABEL]
            others[key] = others.get(key, 0) + n.gpus
        if n.mig is not None:
            key = f"{n.gpu_model}:{n.mig.profile}"
            slices[key] = slices.get(key, 0) + n.gpus * n.mig.slices_per_gpu
        for profile, count in sorted(n.mig_profiles.items()):  # mixed MIG
            key = f"{n.gpu_model}:{profile}"
            slices[key] = slices.get(key, 0) + count
        if n.sharing is not None:  # shared GPUs: milli-GPUs of compute and MiB of GPU memory (when known)
            key = f"{n.gpu_model}:gpu-share"
            slices[key] = slices.get(key, 0) + n.shared_gpus * 1000
            if n.sharing.gpu_memory_mib:
                key = f"{n.gpu_model}:gpu-memory"
                slices[key] = slices.get(key, 0) + n.shared_gpus * n.sharing.gpu_memory_mib
        # a MIG node's GPUs count as whole GPUs too: a slice pod without a slice quota is charged whole GPUs
        gpus[n.gpu_model] = gpus.get(n.gpu_model, 0) + n.gpus
    return Inventory(gpus=dict(sorted(gpus.items())), slices=dict(sorted(slices.items())), nodes=count,
                     others=dict(sorted(others.items())))


@dataclass(frozen=True)
class QueueJobs:
    pending: int = 0
    admitted: int = 0

    @property
    def any(self) -> bool:
        return self.pending + self.admitted > 0


@dataclass(frozen=True)
class ConfigCheck:
    diff: tuple[str, ...]
    warnings: tuple[str, ...]
    refusals: tuple[str, ...]

    @property
    def refused(self) -> bool:
        return bool(self.refusals)

    def reason(self) -> str:
        """One line: why the change is refused, and how to apply it anyway."""
        return "; ".join(self.refusals) + " (apply with --force, or force: true, to override; it is audited)"


def guarantees(config: QueuesConfig) -> dict[str, int]:
    """Nominal quota per quota key, summed over queues and cohorts' own pools: what admission promises at once."""
    out: dict[str, int] = {}
    pools = [q.quotas for q in config.queues] + [c.quotas for c in config.cohorts]
    for quotas in pools:
        for key, quota in quotas.items():
            out[key] = out.get(key, 0) + quota.nominal
    return dict(sorted(out.items()))


def _quota_text(q: FlavorQuota | None) -> str:
    if q is None:
        return "-"
    text = str(q.nominal)
    if q.borrowing_limit is not None:
        text += f" (borrow ≤{q.borrowing_limit})"
    if q.lending_limit is not None:
        text += f" (lend ≤{q.lending_limit})"
    return text


def diff(old: QueuesConfig | None, new: QueuesConfig) -> list[str]:
    """Queues added, removed and changed (quotas before→after, cohort, teams, weight), cohorts and priority classes
    added or removed; empty when nothing a person reads changed."""
    before = {q.name: q for q in old.queues} if old is not None else {}
    after = {q.name: q for q in new.queues}
    out: list[str] = []
    for name in sorted(after.keys() - before.keys()):
        q = after[name]
        quotas = ", ".join(f"{k} {_quota_text(v)}" for k, v in q.quotas.items()) or "no quota"
        out.append(f"+ queue {name}: {quotas}" + (f", cohort {q.cohort}" if q.cohort else ""))
    for name in sorted(before.keys() - after.keys()):
        out.append(f"- queue {name}")
    for name in sorted(before.keys() & after.keys()):
        a, b = before[name], after[name]
        changes = [f"{k} {_quota_text(a.quotas.get(k))} → {_quota_text(b.quotas.get(k))}"
                   for k in sorted(a.quotas.keys() | b.quotas.keys()) if a.quotas.get(k) != b.quotas.get(k)]
        if a.cohort != b.cohort:
            changes.append(f"cohort {a.cohort or '-'} → {b.cohort or '-'}")
        if a.teams != b.teams:
            changes.append(f"teams {','.join(a.teams) or '-'} → {','.join(b.teams) or '-'}")
        if a.weight != b.weight:
            changes.append(f"weight {a.weight:g} → {b.weight:g}")
        if a != b and not changes:
            changes.append("other settings")
        if changes:
            out.append(f"~ queue {name}: {'; '.join(changes)}")
    for what, olds, news in (
            ("cohort", {c.name for c in old.cohorts} if old else set(), {c.name for c in new.cohorts}),
            ("priority class", {p.name for p in old.priority_classes} if old else set(),
             {p.name for p in new.priority_classes})):
        out += [f"+ {what} {n}" for n in sorted(news - olds)]
        out += [f"- {what} {n}" for n in sorted(olds - news)]
    if old is not None and old.policy != new.policy:
        out.append("~ policy")
    return out


def check_change(old: QueuesConfig | None, new: QueuesConfig, inventory: Inventory,
                 jobs: Mapping[str, QueueJobs]) -> ConfigCheck:
    """The diff from the version in force (`old`; None: none recorded yet), the warnings, and what is refused."""
    warnings = list(new.warnings())
    refusals: list[str] = []
    now, was = guarantees(new), guarantees(old) if old is not None else {}
    if not inventory.known:
        warnings.append("no node announced yet (no executor has reported the cluster): quotas were not checked "
                        "against capacity")
    else:
        models = inventory.models()
        for key, total in now.items():
            model = base_model(key)
            if key.startswith(POOL) and key not in inventory.others:
                pools = sorted(k[len(POOL):] for k in inventory.others if k.startswith(POOL))
                message = (f"quota for node pool {key[len(POOL):]}, which no node carries (label {POOL_LABEL}; "
                           f"pools: {', '.join(pools) or 'none'})")
                (refusals if key not in was else warnings).append(message)
                continue
            if model not in models and not is_non_gpu(key):
                message = (f"quota for GPU model {model}, which the cluster does not have "
                           f"(it has: {', '.join(sorted(models)) or 'none'})")
                (refusals if key not in was else warnings).append(message)
                continue
            have = inventory.capacity(key)
            if have is None or total <= have:
                continue
            message = (f"guaranteed {key} sums to {total} but the cluster has {have}: guarantees cannot all be "
                       "honoured at once")
            # refused when this change raises it past capacity; a cluster that shrank under it is a warning
            (refusals if total > was.get(key, 0) else warnings).append(message)
        _unknown_pools(old, new, inventory, refusals, warnings)
    if old is not None:
        for name in sorted({q.name for q in old.queues} - {q.name for q in new.queues}):
            held = jobs.get(name, QueueJobs())
            if held.any:
                refusals.append(f"removes queue {name}, which holds {held.admitted} admitted (running) and "
                                f"{held.pending} pending job(s)")
    return ConfigCheck(diff=tuple(diff(old, new)), warnings=tuple(warnings), refusals=tuple(refusals))


def _unknown_pools(old: QueuesConfig | None, new: QueuesConfig, inventory: Inventory, refusals: list[str],
                   warnings: list[str]) -> None:
    """A node pool a queue's `pools` lists that no node carries: a job admission gave it would wait for nodes that
    are not there. Refused when the change lists it, a warning when the pool's nodes went under it."""
    carried = sorted(k[len(POOL):] for k in inventory.others if k.startswith(POOL))
    for q in new.queues:
        listed_before = set()
        if old is not None and (was := old.queue_map.get(q.name)) is not None:
            listed_before = set(was.pools or ())
        for pool in q.pools or ():
            if POOL + pool not in inventory.others:
                message = (f"queue {q.name} lists node pool {pool} under pools, which no node carries (label "
                           f"{POOL_LABEL}; pools: {', '.join(carried) or 'none'})")
                (refusals if pool not in listed_before else warnings).append(message)
