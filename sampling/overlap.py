"""Keeping the device busy: device→host copies that do not stall it, and a queue that runs the device's
work in launch order on a thread of its own.

On CUDA the sampled ids are copied into a pinned host buffer on a side stream and waited on with an
event, so the host blocks only on that copy, never on ``synchronize()`` of everything queued.

``DeviceQueue`` is what a CUDA stream is to the host, for any device: the engine's one-step-ahead loop
submits a step's forward and sampling to it and goes on with the host work of the step before. On the
CPU the "device" is that thread: torch ops release the GIL, so the forward runs while the host thread
accepts tokens into the matchers, detokenizes and schedules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["DeviceQueue", "HostCopier"]

T = TypeVar("T")


class HostCopier:
    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self._stream = torch.cuda.Stream(device)
            self._host = torch.empty(max_rows, dtype=torch.long, pin_memory=True)
            self._event = torch.cuda.Event()

    def start(self, ids: torch.Tensor) -> Callable[[], list[int]]:
        """Begin copying ``ids`` ``[B]`` to the host; the returned function waits and gives the list."""
        if not self.is_cuda:
            return ids.tolist
        n = ids.shape[0]
        self._stream.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(self._stream):
            self._host[:n].copy_(ids, non_blocking=True)
            self._event.record()
        ids.record_stream(self._stream)  # keep ids' memory alive until the side stream is done with it

        def wait() -> list[int]:
            self._event.synchronize()
            return self._host[:n].tolist()

        return wait


class DeviceQueue:
    """Runs submitted work one job at a time, in submission order, on one thread (under inference mode).

    One thread, so every torch op the queue runs uses one OpenMP pool: two threads running torch ops
    at once give two pools that spin against each other (step.py's docstring has the numbers).
    """

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-device")
        self._idle_since = time.perf_counter()  # when the last job ended (read and written on the thread)
        self._gap = 0.0

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Queue ``fn(*args)`` behind everything submitted before it."""
        return self._thread.submit(self._run, time.perf_counter(), fn, *args)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the queue and wait for its result (or its exception)."""
        return self.submit(fn, *args).result()

    def idle_before(self) -> float:
        """On the queue's thread, inside a job: seconds the queue sat empty before this job was submitted
        (0 when it was queued behind another): device time the host did not keep busy."""
        return self._gap

    def _run(self, submitted: float, fn: Callable[..., T], *args: object) -> T:
        self._gap = max(0.0, submitted - self._idle_since)
        try:
            with torch.inference_mode():
                return fn(*args)
        finally:
            self._idle_since = time.perf_counter()

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
