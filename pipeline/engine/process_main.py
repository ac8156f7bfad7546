"""The engine process's entry point: read the spec, load the model, then serve (``pipeline.engine.server``).

Started as ``python -c`` with ``main``, as the preparation workers are (``stages/process_pool.py`` says
why not a ``multiprocessing`` spawn). It exits when the socket closes, and the kernel kills it when the
serving process dies (``PR_SET_PDEATHSIG``), so it is never left behind.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
from pathlib import Path

import torch

from pipeline.engine.arena import EngineArena
from pipeline.engine.factory import build_llm_engine
from pipeline.engine.images import EngineImages
from pipeline.engine.server import EngineServer
from pipeline.engine.spec import SpanBuffer
from pipeline.engine.threads import engine_threads
from pipeline.engine.wire import ENCODER, Fatal, FrameReader, Ready, frame
from vision.checkpoint import Checkpoint
from vision.child_process import die_with_parent
from vision.encoder import VisionEncoder
from vision.heap import freeze_heap

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _first_frame(sock: socket.socket, reader: FrameReader) -> bytes:
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise EOFError("the serving process closed the socket before the spec")
        frames = reader.feed(data)
        if frames:  # nothing else is sent before our Ready
            return frames[0]


def _set_niceness(nice: int) -> None:
    """Run at niceness ``nice``, before any other thread starts (Linux: threads inherit it)."""
    if nice == os.getpriority(os.PRIO_PROCESS, 0):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:  # raising priority needs CAP_SYS_NICE
        logger.warning(
            "engine process: niceness %d not permitted, running at %d", nice, os.getpriority(os.PRIO_PROCESS, 0)
        )


def main(fd: int) -> None:
    """The engine process's entry point: ``fd`` is its end of the socket pair (the spec's frame names the
    engine arena's descriptor, inherited like ``fd``; None: every add's tensors come inline)."""
    sock = socket.socket(fileno=fd)
    parent_pid, spec, arena_fd = pickle.loads(_first_frame(sock, FrameReader()))
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it stops us
    _set_niceness(spec.config.engine_process_nice)
    try:
        checkpoint = Checkpoint(Path(spec.checkpoint_path))
        spans = SpanBuffer() if spec.trace else None
        engine = build_llm_engine(checkpoint, spec.config, device=spec.device, tracer=spans)
        threads = engine_threads(spec.config.engine_torch_threads, engine.runner.num_parameters)
        if threads:
            torch.set_num_threads(threads)
        arena = EngineArena.attach(arena_fd) if arena_fd is not None else None
        images = None
        if spec.encodes:
            hidden = int(checkpoint.text_config.hidden_size)
            images = EngineImages(VisionEncoder(checkpoint, device=spec.device), hidden)
        server = EngineServer(sock, engine, spec, checkpoint, arena, spans, images)  # builds the grammar stage
    except Exception as exc:  # report why, then exit: the serving process's start fails with it
        sock.sendall(frame(ENCODER.encode(Fatal(f"{type(exc).__name__}: {exc}"))))
        return
    freeze_heap()  # the model and the grammar stage stay: no collection walks them again
    server.send(Ready(os.getpid()))
    try:
        server.serve()
    finally:
        server.grammars.close()
