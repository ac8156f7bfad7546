"""Compile threads: long-lived, a large stack each, one set per niceness, a thread per call in flight."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import anyio
import pytest

from stages.grammar.native_calls import COMPILE_STACK_BYTES, LargeStackThreads, run_on_large_stack

pytestmark = pytest.mark.anyio


def _stack_bytes() -> int:
    """The calling thread's stack size (glibc's ``pthread_getattr_np``)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.pthread_self.restype = ctypes.c_ulong  # a pthread_t, not the default int
    attr = ctypes.create_string_buffer(128)  # pthread_attr_t: 56 bytes on x86_64 and aarch64
    assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
    address, size = ctypes.c_void_p(), ctypes.c_size_t()
    assert libc.pthread_attr_getstack(attr, ctypes.byref(address), ctypes.byref(size)) == 0
    libc.pthread_attr_destroy(attr)
    return size.value


@pytest.mark.skipif(sys.platform != "linux", reason="reads the stack through glibc")
def test_calls_run_on_a_large_stack_and_one_thread_serves_calls_in_turn() -> None:
    threads = LargeStackThreads()
    # the next call is submitted the moment the last one's outcome is out: the thread is idle by then
    seen = [threads.submit(lambda: (threading.get_ident(), _stack_bytes())).result(timeout=10) for _ in range(200)]
    assert threads.started == 1 and len({ident for ident, _ in seen}) == 1  # reused, not one per call
    assert all(size >= COMPILE_STACK_BYTES for _, size in seen)
    assert threading.stack_size() == 0  # the process-wide setting is back to the default


def test_calls_in_flight_each_get_a_thread_and_none_waits_behind_another() -> None:
    threads = LargeStackThreads()
    release = threading.Event()
    running = threading.Barrier(3, timeout=10)  # three calls and this test: all meet only if none queued

    def held() -> int:
        running.wait()
        release.wait(10)
        return threading.get_ident()

    futures = [threads.submit(held) for _ in range(2)]
    running.wait()
    release.set()
    assert len({f.result(timeout=10) for f in futures}) == 2 and threads.started == 2
    assert threads.submit(lambda: 1).result(timeout=10) == 1 and threads.started == 2  # an idle one took it


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness")
def test_a_niced_set_runs_its_calls_at_its_niceness_and_failures_reach_the_caller() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    threads = LargeStackThreads(nice=5)
    assert threads.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(10) == min(
        19, base + 5
    )

    class Panic(BaseException):  # what pyo3 raises for a Rust panic
        pass

    def panics() -> None:
        raise Panic("boom")

    with pytest.raises(Panic):
        threads.submit(panics).result(timeout=10)
    assert threads.submit(lambda: 2).result(timeout=10) == 2  # the thread survived it


@pytest.mark.parametrize("abandon", [False, True], ids=["waits", "abandons"])
async def test_a_cancelled_caller_waits_for_its_call_holding_its_token_unless_it_abandons_it(abandon: bool) -> None:
    limiter = anyio.CapacityLimiter(1)
    started, release = threading.Event(), threading.Event()

    def call() -> str:
        started.set()
        release.wait(10)
        return "done"

    scope = anyio.CancelScope()

    async def caller() -> None:
        with scope:
            await run_on_large_stack(call, limiter=limiter, abandon_on_cancel=abandon)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await anyio.to_thread.run_sync(started.wait)
            assert limiter.borrowed_tokens == 1
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            # shielded: the caller still holds its token while the call runs; abandoned: it has left
            assert limiter.borrowed_tokens == (0 if abandon else 1)
            release.set()
    assert limiter.borrowed_tokens == 0
    assert await run_on_large_stack(lambda: 3, limiter=limiter) == 3
