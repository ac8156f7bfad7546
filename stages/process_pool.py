"""ImagePool: a bounded pool of preparation worker processes at low CPU priority.

One interpreter cannot keep its event loop and decode loop responsive while it also decodes and
preprocesses images: every GIL-holding piece of that work delays both, and a thread cannot be given
a lower priority (a niced thread holding the GIL blocks everyone). The pool runs that work in
spawned processes at niceness 19 (``vision/image_worker.py``), one job per worker at a time.

Seen from the stage it behaves like the thread pool it replaces:
- ``limiter`` has one token per worker; a caller cancelled while it waits for one leaves at once.
- A job handed to a worker is waited for inside a shielded scope, so a cancelled caller still
  holds its token until the worker is free again (no backlog can build behind the limiter); its
  result is then dropped.
- A worker that dies (kill -9, a codec crash, out of memory) fails the one job it held with
  ``WorkerCrashed`` (stage ``decode``) and is started again; one stuck past ``job_timeout_s`` is
  killed, its job fails with ``DeadlineExceeded``, and it is started again.
- Image bytes and tensors cross through two shared-memory slabs per worker (``vision/slab.py``);
  nothing is ever written to ``/dev/shm``.

Workers start with ``start_all()`` (the pipeline's start waits for them), or on first use after a
crash; ``aclose()`` stops them. The kernel kills them if the serving process dies (see the worker's
docstring).

A worker is a fresh interpreter that imports only ``vision.image_worker`` (``_launch``), not
a ``multiprocessing`` spawn: spawn runs the parent's main script again in each child, so a user's
script without ``if __name__ == "__main__":`` would start its own pipeline inside every worker
(which then died while starting).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import anyio
import anyio.lowlevel
import torch
from anyio.abc import TaskGroup

from pipeline.errors import (
    DeadlineExceeded,
    ImageDecodeError,
    InvalidRequest,
    PayloadTooLarge,
    PipelineError,
    WorkerCrashed,
)
from vision.image_worker import ImageReply, ImageWorkerSpec
from vision.preprocess import PreparedImage
from vision.slab import Slab

__all__ = ["ImagePool", "PoolStats"]

logger = logging.getLogger(__name__)
_COPY_IN_THREAD_BYTES = 1 << 20  # memcpy of more than this (~0.1 ms per MB) leaves the event loop
_ERRORS: dict[str, type[PipelineError]] = {
    cls.__name__: cls for cls in (PipelineError, InvalidRequest, ImageDecodeError, PayloadTooLarge)
}


# the child's sys.path is the parent's (argv[2:]), as multiprocessing would set it, before any import
_BOOTSTRAP = "import sys; sys.path[:] = sys.argv[2:]; from vision.image_worker import main; main(int(sys.argv[1]))"


def _launch(fd: int) -> subprocess.Popen[bytes]:
    """Start a worker whose end of the pipe is descriptor ``fd``."""
    command = [sys.executable, "-c", _BOOTSTRAP, str(fd), *sys.path]
    return subprocess.Popen(command, pass_fds=(fd,), stdin=subprocess.DEVNULL)


@dataclass
class PoolStats:
    jobs: int = 0
    starts: int = 0
    crashes: int = 0
    timeouts: int = 0
    cpu_seconds: float = 0.0  # the workers' CPU time for their jobs


class _Worker:
    """One slot of the pool: a process, its pipe, and the slabs both ways."""

    def __init__(self, index: int, spec: ImageWorkerSpec, inbox_bytes: int) -> None:
        self.index = index
        self.spec = spec
        self.inbox = Slab.create(f"prep-input-{index}", inbox_bytes)  # outlives restarts of the process
        self.outbox: Slab | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.lock = anyio.Lock()

    @property
    def is_alive(self) -> bool:
        return self.process is not None and self.conn is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def receive(self) -> Any:
        """The worker's next message. :raises EOFError: the worker is gone."""
        assert self.conn is not None
        await anyio.wait_readable(self.conn.fileno())
        return self.conn.recv()

    async def receive_slab(self) -> Slab:
        """The output slab whose descriptor the worker sends next. Waits until it is there: under
        uvloop (Ray Serve's replicas) the pipe is non-blocking once polled, and a read that comes
        before the descriptor fails with EAGAIN."""
        assert self.conn is not None
        await anyio.wait_readable(self.conn.fileno())
        return Slab.attach(recv_handle(self.conn))

    async def start(self, start_timeout_s: float) -> None:
        """Start the process and wait until it has loaded its model parts."""
        parent, child = multiprocessing.Pipe(duplex=True)
        # started from the event loop's thread on purpose (~10 ms, at start and after a crash):
        # the parent-death signal follows the thread that started the process, and the loop's
        # thread lives as long as the pipeline
        try:
            process = _launch(child.fileno())
        finally:
            child.close()
        self.process, self.conn = process, parent
        try:
            parent.send((os.getpid(), self.spec))
            send_handle(parent, self.inbox.fd, process.pid)
            with anyio.fail_after(start_timeout_s):
                message = await self.receive()
            if message[0] != "ready":
                raise WorkerCrashed(f"a preparation worker could not start: {message[1]}", stage="decode")
            self.outbox = await self.receive_slab()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                self.stop(kill=True)
                await anyio.to_thread.run_sync(self.reap, 5.0)
            if isinstance(exc, TimeoutError):  # an OSError too: first
                message = f"a preparation worker did not start in {start_timeout_s:g} s"
                raise WorkerCrashed(message, stage="decode") from None
            if isinstance(exc, EOFError | OSError):  # it died while starting
                raise WorkerCrashed(f"a preparation worker died while starting ({exc!r})", stage="decode") from None
            raise

    def stop(self, *, kill: bool = False) -> None:
        """End the process (a stop message, or SIGKILL) and close our ends; the inbox stays."""
        if self.process is not None and self.conn is not None and not kill:
            try:
                self.conn.send(("stop",))
            except OSError:
                kill = True
        if self.process is not None and kill and self.process.poll() is None:
            self.process.kill()
        if self.conn is not None:
            self.conn.close()
        if self.outbox is not None:
            self.outbox.close()
        self.conn, self.outbox = None, None

    def reap(self, timeout_s: float) -> int | None:
        """Wait for the stopped process to exit (in a thread); its exit code."""
        process, self.process = self.process, None
        if process is None:
            return None
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
        # SIGKILL cannot be refused, but a process in uninterruptible I/O (a loaded machine paging
        # torch in) dies only when the I/O ends: wait for it
        return process.wait()


class ImagePool:
    """``size`` worker processes preparing one image each at a time."""

    def __init__(
        self,
        spec: ImageWorkerSpec,
        *,
        size: int,
        max_image_bytes: int,
        job_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.spec = spec
        self.job_timeout_s = job_timeout_s
        self.start_timeout_s = start_timeout_s
        self.limiter = anyio.CapacityLimiter(size)
        self.stats = PoolStats()
        self._workers = [_Worker(i, spec, max_image_bytes) for i in range(size)]
        self._idle: deque[_Worker] = deque(self._workers)
        self._tg: TaskGroup | None = None
        self._starting: set[anyio.CancelScope] = set()
        self._closed = False

    def pids(self) -> list[int]:
        """Process ids of the running workers."""
        return [w.pid for w in self._workers if w.is_alive and w.pid is not None]

    def attach(self, tg: TaskGroup) -> None:
        """Where workers found dead are started again in the background."""
        self._tg = tg

    async def start_all(self) -> None:
        """Start every worker now; returns when each has started (or failed to: that one is logged,
        and the next job that needs it tries again)."""
        async with anyio.create_task_group() as tg:
            for worker in self._workers:
                tg.start_soon(self._ensure_started, worker)

    async def run(self, data: bytes, *, field: str) -> PreparedImage:
        """Decode and preprocess (and encode, per the spec) one image in a worker.

        :raises ImageDecodeError, PayloadTooLarge: the image's own fault.
        :raises WorkerCrashed: the worker died with the job.
        :raises DeadlineExceeded: the worker took longer than ``job_timeout_s``; it was killed.
        """
        async with self.limiter:
            worker = self._idle.popleft()
            try:
                with anyio.CancelScope(shield=True):  # the worker finishes anyway: wait for it
                    result = await self._run_on(worker, data, field)
            finally:
                self._idle.append(worker)
        await anyio.lowlevel.checkpoint_if_cancelled()
        return result

    async def _run_on(self, worker: _Worker, data: bytes, field: str) -> PreparedImage:
        async with worker.lock:
            if not worker.is_alive:
                await self._start(worker)
        assert worker.conn is not None
        if len(data) > _COPY_IN_THREAD_BYTES:
            await anyio.to_thread.run_sync(worker.inbox.write_bytes, data)
        else:
            worker.inbox.write_bytes(data)
        self.stats.jobs += 1
        try:
            worker.conn.send(("job", len(data), field))
            with anyio.move_on_after(self.job_timeout_s) as deadline:
                message = await worker.receive()
        except (EOFError, OSError):
            raise await self._crashed(worker, field) from None
        if deadline.cancelled_caught:
            self.stats.timeouts += 1
            logger.error("preparation worker %s stuck for %.0f s: killed", worker.pid, self.job_timeout_s)
            await self._discard(worker, kill=True)
            raise DeadlineExceeded(
                f"image preparation took longer than {self.job_timeout_s:g} s", field=field, stage="decode"
            )
        if message[0] == "error":
            _, kind, text, err_field = message
            raise _ERRORS.get(kind, PipelineError)(text, field=err_field or field, stage="decode")
        return await self._read_reply(worker, message[1])

    async def _read_reply(self, worker: _Worker, reply: ImageReply) -> PreparedImage:
        assert worker.conn is not None and worker.outbox is not None
        if reply.new_slab:
            worker.outbox.close()
            worker.outbox = await worker.receive_slab()
        self.stats.cpu_seconds += reply.cpu_s
        nbytes = torch.Size(reply.shape).numel() * reply.dtype.itemsize
        if nbytes > _COPY_IN_THREAD_BYTES:
            tensor = await anyio.to_thread.run_sync(worker.outbox.read_tensor, reply.shape, reply.dtype)
        else:
            tensor = worker.outbox.read_tensor(reply.shape, reply.dtype)
        if reply.is_embeds:
            return PreparedImage(None, reply.grid_thw, embeds=tensor)
        return PreparedImage(tensor, reply.grid_thw)

    async def _start(self, worker: _Worker) -> None:
        if self._closed:
            raise PipelineError("the preparation pool is closed", stage="decode")
        self.stats.starts += 1
        started = time.perf_counter()
        await worker.start(self.start_timeout_s)
        logger.info("preparation worker %s ready in %.1f s", worker.pid, time.perf_counter() - started)

    async def _crashed(self, worker: _Worker, field: str) -> WorkerCrashed:
        self.stats.crashes += 1
        pid = worker.pid
        code = await self._discard(worker, kill=True)
        logger.error("preparation worker %s died (exit code %s) holding an image; starting another", pid, code)
        return WorkerCrashed(
            f"the preparation worker died (exit code {code}) while preparing this image", field=field, stage="decode"
        )

    async def _discard(self, worker: _Worker, *, kill: bool) -> int | None:
        worker.stop(kill=kill)
        code = await anyio.to_thread.run_sync(worker.reap, 5.0)
        self._restart_soon(worker)
        return code

    def _restart_soon(self, worker: _Worker) -> None:
        if self._tg is not None and not self._closed:
            self._tg.start_soon(self._ensure_started, worker)

    async def _ensure_started(self, worker: _Worker) -> None:
        with anyio.CancelScope() as scope:  # aclose() cancels starts in the background
            self._starting.add(scope)
            try:
                async with worker.lock:
                    if worker.is_alive or self._closed:
                        return
                    await self._start(worker)
            except Exception:  # the next job that needs it tries again, and reports why
                logger.exception("preparation worker %d could not start", worker.index)
            finally:
                self._starting.discard(scope)

    async def aclose(self) -> None:
        """Stop every worker and free the slabs (waits for running jobs' workers to exit)."""
        self._closed = True
        for scope in self._starting:
            scope.cancel()
        with anyio.CancelScope(shield=True):
            for worker in self._workers:
                async with worker.lock:  # a start being cancelled has ended
                    worker.stop()
            # every worker was told to stop above: wait for them together, so a shutdown waits for
            # the slowest one rather than the sum (two low-priority workers beside a busy core took
            # 5 s each, one after the other, and held serve 13 s past a 1 s shutdown timeout)
            async with anyio.create_task_group() as tg:
                for worker in self._workers:
                    tg.start_soon(partial(anyio.to_thread.run_sync, worker.reap, 5.0))
            for worker in self._workers:
                worker.inbox.close()
