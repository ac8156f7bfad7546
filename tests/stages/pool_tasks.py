"""Job functions for the preparation pool's tests, loaded by the worker processes by name.

Each factory takes the worker's spec and returns ``(data, field) -> (tensor, rows, cols, is_embeds)``.
A job's bytes say what to do: ``echo``, ``crash`` (the process kills itself, as a codec crash
would), ``hang`` (never returns), ``gate:PATH`` (waits until the test writes to the FIFO at PATH).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from pipeline.types import ImageDecodeError

__all__ = ["scripted"]


def scripted(spec: Any) -> Callable[[bytes, str], tuple[torch.Tensor, int, int, bool]]:
    def run(data: bytes, field: str) -> tuple[torch.Tensor, int, int, bool]:
        command, _, arg = data.decode().partition(":")
        if command == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if command == "hang":
            time.sleep(3600)
        if command == "gate":
            with open(arg, "rb") as fifo:  # blocks until the test opens the FIFO for writing
                fifo.read()
        if command == "bad":
            raise ImageDecodeError("not an image", field=field)
        if command == "big":  # more than the first output slab holds: the worker sends a bigger one
            return torch.arange(4 * 1024 * 1024, dtype=torch.float32).view(-1, 1024), 1, 1, True
        return torch.full((2, 3), float(len(data))), 1, 2, True

    return run
