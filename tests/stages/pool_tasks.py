"""Job functions for the preparation pool's tests, loaded by the worker processes by name.

Each factory takes the worker's spec and returns ``(data, field) -> (tensor, rows, cols, is_embeds)``.
A job's bytes say what to do: ``echo``, ``crash`` (the process kills itself, as a codec crash
would), ``hang`` (never returns), ``gate:PATH`` (waits until the test writes to the FIFO at PATH).
"""

from __future__ import annotations

import io
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch

from pipeline.errors import ImageDecodeError

__all__ = ["crash_on_width_48", "scripted"]


def crash_on_width_48(spec: Any) -> Callable[[bytes, str], tuple[torch.Tensor, tuple[int, int, int], bool]]:
    """The real job, but the process dies (as in a codec crash) on any image 48 pixels wide."""
    from vision.image_worker import ImageTask

    real = ImageTask(spec)

    def run(data: bytes, field: str) -> tuple[torch.Tensor, tuple[int, int, int], bool]:
        from PIL import Image

        if Image.open(io.BytesIO(data)).size[0] == 48:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(data, field)

    return run


def scripted(spec: Any) -> Callable[[bytes, str], tuple[torch.Tensor, tuple[int, int, int], bool]]:
    def run(data: bytes, field: str) -> tuple[torch.Tensor, tuple[int, int, int], bool]:
        command, _, arg = data.decode().partition(":")
        if command == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if command == "hang":  # a stuck codec: blocks until the pool kills the process
            threading.Event().wait()
        if command == "gate":
            with open(arg, "rb") as fifo:  # blocks until the test opens the FIFO for writing
                fifo.read()
        if command == "bad":
            raise ImageDecodeError("not an image", field=field)
        if command == "big":  # more than the first output slab holds: the worker sends a bigger one
            return torch.arange(4 * 1024 * 1024, dtype=torch.float32).view(-1, 1024), (1, 1, 1), True
        return torch.full((2, 3), float(len(data))), (1, 1, 2), True

    return run
