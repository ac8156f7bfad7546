"""How a stage runs its CPU work: in a worker thread under its limiter, counting thread CPU time.

``inline=True`` runs the work on the event loop instead. That is the naive design this project
replaces; it exists only so the ``health`` benchmark can measure against it in the same run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import anyio
import torch

__all__ = ["Offload"]

T = TypeVar("T")
_worker = threading.local()


class Offload:
    def __init__(self, limiter: anyio.CapacityLimiter, *, inline: bool = False, torch_threads: int = 1) -> None:
        self.limiter = limiter
        self.inline = inline
        self.torch_threads = torch_threads
        self.cpu_seconds = 0.0  # thread CPU time of every call, for CPU-seconds per request per stage
        self.calls = 0
        self._lock = threading.Lock()

    def _timed(self, fn: Callable[..., T], *args: object) -> T:
        if not self.inline and getattr(_worker, "torch_threads", None) != self.torch_threads:
            # torch's intra-op thread count is per calling thread: preparation runs many small ops in
            # several threads at once, where one OpenMP thread each wastes less CPU spinning than two
            # (measured by the prep bench: base64 images 50 -> 55 req/s, 28 -> 25 CPU ms per request).
            # The decode engine's forward thread keeps torch's default.
            torch.set_num_threads(self.torch_threads)
            _worker.torch_threads = self.torch_threads
        started = time.thread_time()
        try:
            return fn(*args)
        finally:
            spent = time.thread_time() - started
            with self._lock:
                self.cpu_seconds += spent
                self.calls += 1

    async def run_holding_token(self, fn: Callable[..., T], *args: object) -> T:
        """Like ``run``, for a caller that already holds a token of ``limiter`` on the work's behalf."""
        if self.inline:
            return self._timed(fn, *args)
        return await anyio.to_thread.run_sync(self._timed, fn, *args)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread. A cancelled caller still waits for the thread: the
        limiter token is held until it returns, so cancelled work never piles up in the executor."""
        if self.inline:
            return self._timed(fn, *args)
        return await anyio.to_thread.run_sync(self._timed, fn, *args, limiter=self.limiter)
