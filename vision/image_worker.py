"""The preparation worker process: decode, image processor and (on the CPU) the vision encoder.

It runs at a low CPU priority in its own interpreter, so its GIL-holding work (Pillow glue, the
processor's Python) delays neither the serving process's event loop nor its decode loop, and the
kernel gives the cores to those first. The parent's side is ``stages/process_pool.py``.

Protocol over one duplex pipe (a Unix socket), one job at a time:

    parent                                   worker
    (parent pid, spec) ──────────────────▶   nice, parent-death signal, load the task
    input slab fd (SCM_RIGHTS) ──────────▶
                                        ◀──  ("ready", pid) + output slab fd
    image bytes into the input slab
    ("job", num_bytes, field) ───────────▶   decode + processor (+ encoder)
                                        ◀──  ("ok", ImageReply) [+ a bigger output slab fd]
                                        ◀──  or ("error", kind, message, field)
    ("stop",) ───────────────────────────▶   exits

The worker is its own interpreter, started as ``python -c`` with ``main`` (``stages/process_pool.py``
says why not a ``multiprocessing`` spawn): it reads the serving process's pid and the spec from the
pipe first. It exits when the pipe closes, and the kernel kills it when the serving process dies
(``PR_SET_PDEATHSIG``), so it is never left behind.
"""

from __future__ import annotations

import importlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path

import torch

from pipeline.errors import PipelineError
from vision.child_process import die_with_parent
from vision.heap import freeze_heap
from vision.preprocess import GridThw
from vision.slab import Slab

__all__ = ["ImageReply", "ImageTask", "ImageWorkerSpec", "main", "worker_main"]

ImageFn = Callable[[bytes, str], tuple[torch.Tensor, GridThw, bool]]
_FIRST_OUTPUT_SLAB = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ImageWorkerSpec:
    """What a worker loads once, and how it runs."""

    checkpoint_path: str
    max_pixels: int
    target_longest_edge: int | None
    encode: bool  # run the vision encoder here (CPU engines) or return the pixels (GPU engines)
    nice: int = 19  # added to the worker's CPU niceness: 19 is the lowest priority
    # "module:factory" of the job function, factory(spec) -> ImageFn; tests swap in faulty ones
    task: str = "vision.image_worker:ImageTask"


@dataclass(frozen=True, slots=True)
class ImageReply:
    """One image's result, its tensor waiting in the output slab."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grid_thw: GridThw  # the image's token grid (vision/preprocess.py)
    is_embeds: bool  # the tensor is the encoder's output [tokens, hidden], else the processor's pixels
    cpu_s: float  # the worker's CPU time for the job
    new_slab: bool  # a bigger output slab's fd follows this reply


class ImageTask:
    """The default job: bytes → RGB → the checkpoint's processor → (the encoder's embeddings)."""

    def __init__(self, spec: ImageWorkerSpec) -> None:
        from vision.checkpoint import Checkpoint
        from vision.encoder import VisionEncoder

        self.spec = spec
        checkpoint = Checkpoint(Path(spec.checkpoint_path))
        self.processor = checkpoint.image_processor
        self.encoder = VisionEncoder(checkpoint, device="cpu") if spec.encode else None

    def __call__(self, data: bytes, field: str) -> tuple[torch.Tensor, GridThw, bool]:
        from vision.image_io import check_scalable, decode_image
        from vision.preprocess import preprocess_image

        spec = self.spec
        image = decode_image(
            data, max_pixels=spec.max_pixels, target_longest_edge=spec.target_longest_edge, field=field
        )
        check_scalable(image.size, spec.target_longest_edge, field)
        prepared = preprocess_image(self.processor, image, field=field)
        assert prepared.pixel_values is not None
        if self.encoder is None:
            return prepared.pixel_values, prepared.grid_thw, False
        return self.encoder.encode([prepared])[0], prepared.grid_thw, True


def _load_task(spec: ImageWorkerSpec) -> ImageFn:
    module, _, name = spec.task.partition(":")
    factory = getattr(importlib.import_module(module), name)
    task: ImageFn = factory(spec)
    return task


def main(fd: int) -> None:
    """A worker process's entry point: ``fd`` is its end of the pipe; the parent's pid and the spec
    come first on it."""
    conn = Connection(fd)
    parent_pid, spec = conn.recv()
    worker_main(conn, parent_pid, spec)


def worker_main(conn: Connection, parent_pid: int, spec: ImageWorkerSpec) -> None:
    """The worker's whole life: set up, serve jobs until told to stop or the pipe closes."""
    die_with_parent(parent_pid)
    if spec.nice:
        os.nice(spec.nice)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it stops us
    torch.set_num_threads(1)  # one core per worker: the pool's size is the parallelism
    try:
        task = _load_task(spec)
        inbox = Slab.attach(recv_handle(conn))
        outbox = Slab.create("prep-output", _FIRST_OUTPUT_SLAB)
    except Exception as exc:  # report why, then exit: the parent fails the job that waited
        conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    freeze_heap()  # the processor and the encoder stay: no collection walks them again
    conn.send(("ready", os.getpid()))
    send_handle(conn, outbox.fd, parent_pid)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the serving process closed the pipe or died
            return
        if message[0] == "stop":
            return
        _, num_bytes, field = message
        outbox = _serve(conn, task, inbox, outbox, num_bytes, field, parent_pid)


def _serve(
    conn: Connection, task: ImageFn, inbox: Slab, outbox: Slab, num_bytes: int, field: str, parent_pid: int
) -> Slab:
    started = time.thread_time()
    try:
        tensor, grid_thw, is_embeds = task(inbox.read_bytes(num_bytes), field)
    except PipelineError as exc:
        conn.send(("error", type(exc).__name__, exc.message, exc.field))
        return outbox
    except Exception as exc:
        conn.send(("error", "PipelineError", f"image preparation failed: {type(exc).__name__}: {exc}", field))
        return outbox
    nbytes = tensor.numel() * tensor.element_size()
    grown = nbytes > outbox.size
    if grown:  # keep the old one open until the parent has the new one
        old, outbox = outbox, Slab.create("prep-output", max(nbytes, 2 * outbox.size))
        old.close()
    outbox.write_tensor(tensor)
    reply = ImageReply(tuple(tensor.shape), tensor.dtype, grid_thw, is_embeds, time.thread_time() - started, grown)
    conn.send(("ok", reply))
    if grown:
        send_handle(conn, outbox.fd, parent_pid)
    return outbox
