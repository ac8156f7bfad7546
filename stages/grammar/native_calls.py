"""Where native grammar compiles run: a thread with a large stack, and the heap trimmed after big ones.

- Stack: xgrammar and llguidance recurse in native code, and a native stack overflow kills the
  process (Python never sees an exception). llguidance used about 3.2 KB of stack per ``$ref`` it
  followed: the default 8 MB thread stack overflowed at a chain of 3,000, 64 MB held 20,000. The
  bounds of ``stages.grammar.limits`` keep accepted constraints far below either; the large stack
  is the margin for recursion they do not model. Threads reserve their stack as address space and
  touch only what they use, so a large one costs nothing until a compile needs it. The compile
  threads live as long as the process (``LargeStackThreads``): one started per compile cost more
  than a small compile.
- Heap: a compile's peak is freed to glibc's malloc, which keeps it in its arenas; after a large
  compile ``malloc_trim(0)`` hands the free pages back to the system, so the process returns to
  near its size before the compile.

A compile in a subprocess was the other way to contain a crash: it was not taken because its
result must come back, and neither result crosses cheaply (serializing an xgrammar grammar costs
3-20x its compile; an llguidance matcher is rebuilt, that is compiled again, in this process).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import anyio

__all__ = [
    "COMPILE_STACK_BYTES",
    "LargeStackThreads",
    "large_stack_threads",
    "lower_priority",
    "release_free_memory",
    "run_on_large_stack",
]

T = TypeVar("T")

COMPILE_STACK_BYTES = 64 * 1024 * 1024
# threading.stack_size() is process-wide: set it, start the thread, set it back, under one lock
_STACK_LOCK = threading.Lock()


class LargeStackThreads:
    """Long-lived daemon threads with a ``stack_bytes`` stack, ``nice`` added to their niceness once
    when each starts. ``submit`` hands a call to an idle one, or starts one when none is idle, so calls
    never queue behind each other (their callers bound how many run at once).

    A thread started for each compile has to get the GIL before ``start()`` returns and again before
    its ``join()`` does: in a py-spy profile of the engine process serving text-only
    requests with new schemas on this 2-core machine, 0.8 ms of CPU per compile (its llguidance
    compile itself 2.3 ms there).
    """

    def __init__(self, *, nice: int = 0, stack_bytes: int = COMPILE_STACK_BYTES, name: str = "grammar-compile") -> None:
        self.nice = nice
        self.stack_bytes = stack_bytes
        self.name = name
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a call that no submit has claimed yet
        self.started = 0  # threads started so far

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` on one of the threads; its outcome in the future returned."""
        future: Future[T] = Future()
        with self._lock:
            claimed = self._idle > 0
            if claimed:
                self._idle -= 1
            else:
                self.started += 1
        self._calls.put((fn, future))
        if not claimed:
            self._start_thread()
        return future

    def _start_thread(self) -> None:
        # daemon: a compile abandoned at shutdown must not keep the interpreter from exiting
        thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        with _STACK_LOCK:
            previous = threading.stack_size(self.stack_bytes)
            try:
                thread.start()
            finally:
                threading.stack_size(previous)

    def _serve(self) -> None:
        if self.nice:
            lower_priority(self.nice)
        while True:
            fn, future = self._calls.get()
            result: Any = None
            error: BaseException | None = None
            running = future.set_running_or_notify_cancel()
            if running:
                try:
                    result = fn()
                except BaseException as exc:  # a Rust panic is a BaseException: the caller gets it
                    error = exc
            # idle before the caller hears of its outcome: a call it then submits finds this thread
            with self._lock:
                self._idle += 1
            if running and error is not None:
                future.set_exception(error)
            elif running:
                future.set_result(result)
            del fn, future, result, error  # nothing of the call is held while the thread waits


_THREADS: dict[int, LargeStackThreads] = {}
_THREADS_LOCK = threading.Lock()


def large_stack_threads(nice: int = 0) -> LargeStackThreads:
    """This process's compile threads at ``nice``: one set per niceness, since an unprivileged thread
    cannot lower its niceness again once a background compile has raised it."""
    with _THREADS_LOCK:
        threads = _THREADS.get(nice)
        if threads is None:
            threads = _THREADS[nice] = LargeStackThreads(nice=nice)
        return threads


async def run_on_large_stack(
    fn: Callable[[], T], *, limiter: anyio.CapacityLimiter, nice: int = 0, abandon_on_cancel: bool = False
) -> T:
    """``fn()`` on a compile thread (``large_stack_threads(nice)``) under a token of ``limiter``.

    As ``anyio.to_thread.run_sync``: a cancelled caller still waits for the call to return, unless
    ``abandon_on_cancel`` (its token is then returned at once and the call runs on, unawaited).
    """
    async with limiter:
        future = large_stack_threads(nice).submit(fn)
        with anyio.CancelScope(shield=not abandon_on_cancel):
            # the loop is woken with the outcome (asyncio's bridge, which skips a closed loop): no
            # worker thread waits for the call
            result = await asyncio.wrap_future(future)
    return result


def lower_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's niceness (Linux: per thread, and inherited by the threads it
    starts, such as xgrammar's compile pool); elsewhere a no-op."""
    if sys.platform == "linux":
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice))


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    return trim


_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Give the heap's free pages back to the system (glibc; elsewhere a no-op)."""
    if _TRIM is not None:
        _TRIM(0)
