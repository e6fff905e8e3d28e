"""The process's collector policy (shared/gcpolicy.py): what survives a full collection is frozen, so later full
collections skip it; a periodic thaw still collects reference cycles that died among frozen objects."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from shared import gcpolicy


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def policy_off_after() -> Iterator[None]:
    yield
    gcpolicy.uninstall()
    assert gc.get_freeze_count() == 0


async def test_survivors_of_a_full_collection_are_frozen_on_the_loop(policy_off_after: None) -> None:
    policy = gcpolicy.install(environ={"GPUQ_GC_THAW_S": "0"})
    assert policy is not None and gcpolicy.install(environ={}) is policy  # one per process
    frozen_at_start = gc.get_freeze_count()
    assert frozen_at_start > 0  # start-up's heap
    kept = [Node() for _ in range(5_000)]  # long-lived state made after start-up
    gc.collect()
    await asyncio.sleep(0)  # the freeze runs on the loop, just after the collection
    await asyncio.sleep(0)
    assert policy.freezes >= 1
    assert gc.get_freeze_count() > frozen_at_start
    left = [o for o in gc.get_objects() if isinstance(o, Node)]
    assert not left and len(kept) == 5_000  # frozen: the next full collections do not walk them


async def test_a_cycle_that_dies_among_frozen_objects_waits_for_the_thaw(policy_off_after: None) -> None:
    policy = gcpolicy.install(environ={"GPUQ_GC_THAW_S": "0"})
    assert policy is not None
    a, b = Node(), Node()
    a.other, b.other = b, a
    gc.collect()
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # frozen now
    alive = weakref.ref(a)
    del a, b
    gc.collect()
    assert alive() is not None  # frozen: no collection looks at it
    took = policy.thaw()
    assert alive() is None and policy.thaws == 1 and took >= 0
    assert gc.get_freeze_count() > 0  # and the survivors are frozen again


async def test_the_thaw_runs_on_its_interval(policy_off_after: None) -> None:
    policy = gcpolicy.install(environ={"GPUQ_GC_THAW_S": "0.05"})
    assert policy is not None
    for _ in range(100):
        if policy.thaws >= 2:
            break
        await asyncio.sleep(0.05)
    assert policy.thaws >= 2


async def test_turned_off_it_freezes_nothing(policy_off_after: None) -> None:
    assert gcpolicy.install(environ={"GPUQ_GC_FREEZE": "0"}) is None
    gc.collect()
    await asyncio.sleep(0)
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize(("env", "named"), [({"GPUQ_GC_THAW_S": "ten"}, "GPUQ_GC_THAW_S"),
                                            ({"GPUQ_GC_THAW_S": "-5"}, "GPUQ_GC_THAW_S"),
                                            ({"GPUQ_GC_THAW_S": "nan"}, "GPUQ_GC_THAW_S"),
                                            ({"GPUQ_GC_FREEZE": "maybe"}, "GPUQ_GC_FREEZE")])
def test_a_bad_setting_is_refused_by_name(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        gcpolicy.thaw_setting(env)


def test_settings() -> None:
    assert gcpolicy.thaw_setting({}) == gcpolicy.THAW_EVERY_S
    assert gcpolicy.thaw_setting({"GPUQ_GC_THAW_S": "0"}) == 0.0
    assert gcpolicy.thaw_setting({"GPUQ_GC_FREEZE": "off"}) is None
