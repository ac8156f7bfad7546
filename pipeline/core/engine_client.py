"""ProcessEngine: the decode engine in its own process, seen from the serving process as ``AsyncEngine`` is.

The pipeline uses either through the same calls (``submit``, ``abort``, ``barrier``, ``stats``,
``resources``, ``start``, ``aclose``), so nothing above the engine knows which runs. Commands are
written to the socket through the event loop's own transport (never blocking: a big add waits in its
buffer); each engine step's outputs arrive in one message and are handed to their streams there, as
``AsyncEngine`` hands them over once per step.

Faults: an engine process that dies (kill -9, out of memory, a native crash), or that makes no progress
for ``step_timeout_s`` while it holds requests (it is then killed), fails the requests it held with
``EngineFailed`` (503, retryable); requests submitted while a new one starts get the same; a new
process (the model loaded again) is started in the background and serves what comes after.
``status`` says which (``/health`` reports it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from pipeline.core.engine_process import EngineProcessSpec
from pipeline.core.engine_wire import (
    DECODER,
    Alive,
    BarrierReached,
    Fatal,
    FrameReader,
    Ready,
    Step,
    encode_command,
    encode_input,
    frame,
)
from pipeline.errors import EngineFailed
from sampling.async_engine import Add, EngineQueueFull, OutputStream
from sampling.inputs import EngineInput, SeqOutput

__all__ = ["ProcessEngine"]

logger = logging.getLogger(__name__)

# the child's sys.path is the parent's (argv[2:]), as multiprocessing would set it, before any import
_BOOTSTRAP = (
    "import sys; sys.path[:] = sys.argv[2:]; from pipeline.core.engine_process import main; main(int(sys.argv[1]))"
)
_STOP_WAIT_S = 10.0
_RESTART_PAUSE_S = 1.0  # between attempts when a new engine process fails to start


def _spawn(fd: int) -> subprocess.Popen[bytes]:
    """Start an engine process whose end of the socket pair is descriptor ``fd``."""
    command = [sys.executable, "-c", _BOOTSTRAP, str(fd), *sys.path]
    return subprocess.Popen(command, pass_fds=(fd,), stdin=subprocess.DEVNULL)


class _Connection(asyncio.Protocol):
    """The event loop's end of one engine process's socket."""

    def __init__(self, client: ProcessEngine) -> None:
        self.client = client
        self.reader = FrameReader()
        self.transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        for body in self.reader.feed(data):
            self.client._on_message(self, DECODER.decode(body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._on_lost(self)


class ProcessEngine:
    """The client of one engine process (started again after a failure)."""

    def __init__(
        self,
        spec: EngineProcessSpec,
        *,
        queue_size: int,
        step_timeout_s: float,
        start_timeout_s: float,
        retry_after_s: float,
        token_table: Callable[[], list[bytes]],
    ) -> None:
        self.spec = spec
        self.queue_size = queue_size
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.retry_after_s = retry_after_s
        self._token_table = token_table
        self.status = "starting"  # "ok", "restarting", "stopped"
        self._started = anyio.Event()  # set while status is "ok"
        self.num_failures = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: _Connection | None = None
        self._ready = anyio.Event()
        self._fatal: str | None = None
        self._streams: dict[str, OutputStream] = {}
        self._barriers: dict[int, anyio.Event] = {}
        self._num_barriers = 0
        self._num_sent = 0
        self._num_acked = 0
        self._progress_at = time.monotonic()
        self._hung = False
        self._closing = False
        self._tg: TaskGroup | None = None
        self._stats: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._prefix: dict[str, int] | None = None

    @property
    def pid(self) -> int | None:
        """The engine process's id (None while none runs)."""
        return self._process.pid if self._process is not None else None

    @property
    def token_table(self) -> list[bytes]:
        """Each token id's bytes (built here once: log-probability entries show them)."""
        return self._token_table()

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process and wait until its model is loaded. :raises EngineFailed: it could not."""
        await self._launch()
        self._set_ok()

    def _set_ok(self) -> None:
        self.status = "ok"
        self._started.set()

    async def wait_started(self) -> None:
        """Return once an engine process serves (at once unless one is starting after a failure)."""
        await self._started.wait()

    def attach(self, tg: TaskGroup) -> None:
        """Where the hang watchdog runs and new engine processes are started after a failure."""
        self._tg = tg
        tg.start_soon(self._watch)

    async def aclose(self) -> None:
        """Stop the engine process (a stop message, then SIGKILL after a grace period) and wait for it."""
        self._closing = True
        was_serving, self.status = self.status == "ok", "stopped"
        conn = self._conn
        if conn is not None and conn.transport is not None:
            conn.transport.write(encode_command(("stop",)))
        await self._reap(kill=not was_serving)  # one still loading its model would read the stop late
        if conn is not None and conn.transport is not None:
            conn.transport.close()
        self._conn = None
        self._release_barriers()

    async def _launch(self) -> None:
        # started from the event loop's thread on purpose: the parent-death signal follows the thread
        # that started the process, and the loop's thread lives as long as the pipeline
        parent, child = socket.socketpair()
        try:
            self._process = _spawn(child.fileno())  # ~10 ms on the loop, at start and after a failure
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._ready, self._fatal = anyio.Event(), None
        self._num_sent = self._num_acked = 0
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_unix_connection(lambda: _Connection(self), sock=parent)
        self._conn = conn
        assert conn.transport is not None
        conn.transport.write(frame(pickle.dumps((os.getpid(), self.spec), protocol=pickle.HIGHEST_PROTOCOL)))
        try:
            with anyio.fail_after(self.start_timeout_s):
                await self._ready.wait()
        except TimeoutError:
            self._fatal = f"it did not start in {self.start_timeout_s:g} s"
        if self._fatal is not None or self._conn is None:
            why = self._fatal or f"it exited with code {self._process.poll()} while starting"
            await self._reap(kill=True)
            raise EngineFailed(
                f"the engine process could not start: {why}", retry_after=self.retry_after_s, stage="engine"
            )
        logger.info("engine process %s ready", self.pid)

    async def _reap(self, *, kill: bool = False) -> None:
        """Wait for the engine process to exit (SIGKILL first with ``kill``, or after a grace period)."""
        process, self._process = self._process, None
        if process is None:
            return
        if kill and process.poll() is None:
            process.kill()
        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(process.wait, _STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                await anyio.to_thread.run_sync(process.wait)

    # -- the pipeline's calls ---------------------------------------------------------------------
    def submit(self, inp: EngineInput) -> OutputStream:
        """Send ``inp`` to the engine; its outputs arrive on the returned stream.

        :raises EngineQueueFull: the engine has not read ``queue_size`` commands yet.
        :raises EngineFailed: the engine process is being started again after a failure.
        """
        conn = self._conn
        if self.status != "ok" or conn is None or conn.transport is None:
            raise EngineFailed(
                "the decode engine is restarting after a failure; retry", retry_after=self.retry_after_s, stage="engine"
            )
        if self._num_sent - self._num_acked >= self.queue_size:
            raise EngineQueueFull("the decode engine's queue is full")
        message = encode_command(("add", encode_input(inp)))
        if not self._streams:
            self._progress_at = time.monotonic()  # the hang deadline counts from the first work
        conn.transport.write(message)
        self._num_sent += 1
        stream = OutputStream(Add(inp), inp.sampling.n)
        self._streams[inp.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Free the request's sequences before the engine's next step (never blocks)."""
        if self._streams.pop(request_id, None) is None:
            return
        conn = self._conn
        if conn is not None and conn.transport is not None:
            conn.transport.write(encode_command(("abort", request_id)))
            self._num_sent += 1

    async def barrier(self) -> None:
        """Return once the engine process has handled every command sent before this call (at once
        while no engine process runs: it holds nothing)."""
        conn = self._conn
        if conn is None or conn.transport is None or self.status != "ok":
            return
        self._num_barriers += 1
        token = self._num_barriers
        reached = self._barriers[token] = anyio.Event()
        conn.transport.write(encode_command(("barrier", token)))
        self._num_sent += 1
        await reached.wait()

    @property
    def num_running(self) -> int:
        return len(self._streams)

    def resources(self) -> dict[str, int]:
        """What the engine holds, as of its last message (after a ``barrier``: now)."""
        return {
            "engine_requests": self._held.get("engine_requests", 0),
            "engine_streams": len(self._streams),
            "kv_blocks_used": self._held.get("kv_blocks_used", 0),
        }

    def stats(self) -> dict[str, int]:
        """Decoding as of the engine's last message, for /health and /metrics."""
        return dict(self._stats)

    def prefix_cache_figures(self) -> dict[str, int] | None:
        """The KV prefix cache's counters as of the engine's last message (None: off)."""
        return self._prefix

    # -- from the engine process --------------------------------------------------------------
    def _on_message(self, conn: _Connection, message: Any) -> None:
        if conn is not self._conn:
            return  # a process we have given up on
        self._progress_at = time.monotonic()
        if isinstance(message, Step):
            self._figures(message)
            self._deliver(message.outputs)
        elif isinstance(message, BarrierReached):
            self._figures(message)
            reached = self._barriers.pop(message.token, None)
            if reached is not None:
                reached.set()
        elif isinstance(message, Alive):
            self._num_acked = message.acked
        elif isinstance(message, Ready):
            self._ready.set()
        elif isinstance(message, Fatal):
            self._fatal = message.message

    def _figures(self, message: Step | BarrierReached) -> None:
        self._num_acked = message.acked
        self._stats, self._held, self._prefix = message.stats, message.held, message.prefix

    def _deliver(self, outputs: list[SeqOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.push(output)
            if stream.is_finished:
                del self._streams[output.request_id]

    def _on_lost(self, conn: _Connection) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        self._ready.set()  # a start in progress sees that it failed
        self._release_barriers()
        if self._closing or self.status != "ok":
            return
        self.status = "restarting"
        self._started = anyio.Event()
        self.num_failures += 1
        why = f"made no progress for {self.step_timeout_s:g} s" if self._hung else "died"
        logger.error("engine process %s %s holding %d requests; starting another", self.pid, why, len(self._streams))
        error = EngineFailed(
            f"the decode engine process {why} while it held this request; retry",
            retry_after=self.retry_after_s,
            stage="engine",
        )
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(error)
        self._held, self._stats, self._hung = {}, {}, False
        if self._tg is not None:
            self._tg.start_soon(self._restart)

    def _release_barriers(self) -> None:
        barriers, self._barriers = self._barriers, {}
        for reached in barriers.values():
            reached.set()

    # -- in the background ----------------------------------------------------------------------
    async def _restart(self) -> None:
        await self._reap(kill=True)
        while not self._closing:
            try:
                await self._launch()
            except Exception:
                logger.exception("a new engine process could not start; trying again")
                await anyio.sleep(_RESTART_PAUSE_S)
                continue
            if not self._closing:
                self._set_ok()
            return

    async def _watch(self) -> None:
        """Kill an engine process that holds requests and has sent nothing for ``step_timeout_s``."""
        while True:
            await anyio.sleep(min(1.0, self.step_timeout_s / 4))
            process = self._process
            stalled = time.monotonic() - self._progress_at > self.step_timeout_s
            if self.status == "ok" and self._streams and stalled and process is not None and not self._hung:
                logger.error("engine process %s made no progress for %.0f s: killed", process.pid, self.step_timeout_s)
                self._hung = True
                process.kill()
