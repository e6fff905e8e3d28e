"""shared/forked.py: a pure computation in a forked child, its answer (or its error) back in the parent."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from shared import forked

pytestmark = pytest.mark.skipif(not forked.available(), reason="this platform cannot fork")


async def test_the_result_comes_from_another_process_and_the_loop_goes_on_meanwhile():
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())

    def busy() -> tuple[int, int]:
        end = time.monotonic() + 0.5
        n = 0
        while time.monotonic() < end:  # CPU-bound, never yields the GIL voluntarily
            n += 1
        return os.getpid(), n

    try:
        pid, n = await forked.call(busy)
    finally:
        task.cancel()
    assert pid != os.getpid() and n > 0
    assert ticks >= 10  # the parent's loop kept running while the child computed


async def test_the_child_works_on_a_snapshot_its_changes_never_reach_the_parent():
    state = {"jobs": [1, 2, 3]}

    def mutate() -> list[int]:
        state["jobs"].append(4)
        return list(state["jobs"])

    assert await forked.call(mutate) == [1, 2, 3, 4]
    assert state == {"jobs": [1, 2, 3]}


async def test_an_exception_in_the_child_is_raised_in_the_parent_with_its_type_and_message():
    def fails() -> None:
        raise KeyError("team-07")

    with pytest.raises(forked.ForkedCallError, match="KeyError: 'team-07'"):
        await forked.call(fails)


async def test_a_child_that_dies_without_an_answer_is_an_error_not_a_hang():
    def dies() -> None:
        os._exit(3)

    with pytest.raises(forked.ForkedCallError, match="died without an answer"):
        await forked.call(dies)


async def test_cancelling_the_call_kills_the_child(tmp_path: Path):
    pid_file = tmp_path / "pid"

    def sleeps() -> None:
        pid_file.write_text(str(os.getpid()))
        time.sleep(60)

    task = asyncio.create_task(forked.call(sleeps))
    for _ in range(500):
        if pid_file.exists() and pid_file.read_text():
            break
        await asyncio.sleep(0.01)
    pid = int(pid_file.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(ProcessLookupError):  # killed and reaped: no such process any more
        os.kill(pid, 0)
