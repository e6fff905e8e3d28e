"""Run a CPU-heavy, pure computation in a forked child of the service's process, off its interpreter lock.

A worker thread is off the event loop but not off the GIL: while it computes, the loop's thread gives up the GIL at
every socket call (each Postgres statement, each ack) and waits up to the interpreter's switch interval to get it
back, so a long computation in a thread stretches every batch the handlers work through (admission's ETA replay
made the steady scenario's p99 submit→placed seconds long: docs/benchmarks.md, section 4). A forked child starts
from a copy-on-write snapshot of the process as it is at the fork, so the computation reads the service's state
without copying or pickling it, runs on another core when one is free, and sends back only its (pickled) result.

The child must only compute: it inherits the parent's sockets and must never use them, so the function given must
do no I/O (a pure core, sim/ or services/core). It resets the signal handlers the parent installed, never runs
the parent's event loop, and leaves with os._exit (no atexit hooks, no buffered writes of the parent's, no clean-up
of sockets it shares with the parent). Python 3.12 and later warn (DeprecationWarning) on a fork of a process with
threads: a lock another thread held at the fork stays held in the child. The child here takes none of the parent's
locks (the function is pure; CPython re-initialises the import, logging and allocator locks after a fork).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import pickle
import signal
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ForkedCallError(RuntimeError):
    """The function raised in the child, or the child died before sending its result (the message says which)."""


def available() -> bool:
    """Whether this platform can fork (POSIX)."""
    return hasattr(os, "fork")


async def _read_all(fd: int) -> bytes:
    """Everything written on the pipe `fd` until its other end closes, read on the event loop (no thread: a
    cancelled call leaves nobody reading a descriptor it is about to close)."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        except BlockingIOError:
            return  # more later
        except OSError as exc:
            if not done.done():
                done.set_exception(exc)
            return
        if not done.done():  # end of file: the child closed its end (it exited)
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
    return b"".join(chunks)


def _child(fn: Callable[[], object], fd: int) -> None:
    """In the child: compute, send (ok, value) pickled on `fd`, leave without running any of the parent's clean-up."""
    code = 0
    try:
        # The parent's handlers would write to its event loop's wake-up fd (the same socket in both processes).
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        # The parent's collector callbacks are not the child's: shared/gcpolicy.py's would wake the parent's loop
        # (its wake-up socket is shared) to freeze a heap in the parent that this collection did not touch.
        gc.callbacks.clear()
        try:
            payload = pickle.dumps((True, fn()), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # reported to the parent, whatever it was
            payload = pickle.dumps((False, f"{type(exc).__name__}: {exc}"), protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:  # nothing may escape into the parent's code in this process
        code = 1
    finally:
        os._exit(code)


async def call(fn: Callable[[], T]) -> T:
    """fn() computed in a forked child; its return value must pickle. Raises ForkedCallError when fn raised there
    (with its type and message) or the child died without an answer. Cancelling the call kills the child."""
    if not available():
        raise ForkedCallError("this platform cannot fork")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(fn, write_fd)  # never returns
    os.close(write_fd)
    reaped = False
    try:
        data = await _read_all(read_fd)
        _, status = os.waitpid(pid, 0)  # at once: the pipe's end of file is the child's exit
        reaped = True
    finally:
        os.close(read_fd)
        if not reaped:  # cancelled (or the read failed): the answer is not wanted any more
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    if not data:
        raise ForkedCallError(f"the forked child died without an answer (wait status {status})")
    ok, value = pickle.loads(data)  # our own child's bytes, over a pipe only it and we hold
    if not ok:
        raise ForkedCallError(f"in the forked child: {value}")
    return value
