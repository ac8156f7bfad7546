"""Where native grammar compiles run: a thread with a large stack, and the heap trimmed after big ones.

- Stack: xgrammar and llguidance recurse in native code, and a native stack overflow kills the
  process (Python never sees an exception). llguidance used about 3.2 KB of stack per ``$ref`` it
  followed: the default 8 MB thread stack overflowed at a chain of 3,000, 64 MB held 20,000. The
  bounds of ``stages.grammar_limits`` keep accepted constraints far below either; the large stack
  is the margin for recursion they do not model. Threads reserve their stack as address space and
  touch only what they use, so a large one costs nothing until a compile needs it.
- Heap: a compile's peak is freed to glibc's malloc, which keeps it in its arenas; after a large
  compile ``malloc_trim(0)`` hands the free pages back to the system, so the process returns to
  near its size before the compile.

A compile in a subprocess was the other way to contain a crash: it was not taken because its
result must come back, and neither result crosses cheaply (serializing an xgrammar grammar costs
3-20x its compile; an llguidance matcher is rebuilt, that is compiled again, in this process).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["COMPILE_STACK_BYTES", "lower_priority", "release_free_memory", "run_on_large_stack"]

T = TypeVar("T")

COMPILE_STACK_BYTES = 64 * 1024 * 1024
# threading.stack_size() is process-wide: set it, start the thread, set it back, under one lock
_STACK_LOCK = threading.Lock()


def run_on_large_stack(fn: Callable[[], T], *, stack_bytes: int = COMPILE_STACK_BYTES, nice: int = 0) -> T:
    """``fn()`` in a new thread with a ``stack_bytes`` stack, ``nice`` added to its CPU niceness;
    blocks until it returns or raises."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            if nice:
                lower_priority(nice)
            outcome.append(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)

    # daemon: a compile abandoned at shutdown must not keep the interpreter from exiting
    thread = threading.Thread(target=target, name="grammar-compile", daemon=True)
    with _STACK_LOCK:
        previous = threading.stack_size(stack_bytes)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


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
