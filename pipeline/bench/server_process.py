"""``python -m pipeline serve`` in a child process, for the benchmarks that measure a server as its
users run it (its own process, its own engine process, HTTP in between)."""

from __future__ import annotations

import subprocess
import sys
import threading

import psutil

__all__ = ["ServerProcess"]


class ServerProcess:
    """A server started with ``extra`` options on a free port (``base``: its URL), its RSS sampled on a
    thread every 20 ms (``peak``); ``stop()`` ends it."""

    def __init__(self, extra: list[str]) -> None:
        args = [sys.executable, "-m", "pipeline", "serve", "--port", "0", *extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("serving"):
                self.base = line.rsplit(" ", 1)[-1].strip()
                break
        else:
            raise RuntimeError(f"the server did not start (exit status {self.proc.wait()}): {' '.join(args)}")
        self.process = psutil.Process(self.proc.pid)
        self.peak = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def rss(self) -> int:
        return int(self.process.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.rss())

    def reset_peak(self) -> None:
        self.peak = self.rss()

    def pids(self) -> list[int]:
        """The server's process and its children (the engine process, preparation workers)."""
        return [self.proc.pid, *(child.pid for child in self.process.children(recursive=True))]

    def stop(self) -> None:
        self._stop.set()
        self.proc.terminate()
        self.proc.wait(timeout=60)
