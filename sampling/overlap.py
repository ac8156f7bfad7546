"""Device→host copies that do not stall the device; no-ops on the CPU.

On CUDA the sampled ids are copied into a pinned host buffer on a side stream and waited on with an
event, so the host blocks only on that copy, never on ``synchronize()`` of everything queued.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["HostCopier"]


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
