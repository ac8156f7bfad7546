"""EngineLink: one engine process and the event loop's end of its socket pair.

It starts the process (``python -c``, as the preparation workers are: ``stages/process_pool.py`` says
why not a ``multiprocessing`` spawn), sends it its spec, waits for its ``Ready``, writes commands through
the loop's own transport (never blocking: a big add waits in its buffer), hands every later message
to its owner, and says once when the socket closed. ``pipeline.engine.client`` owns the links.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any, cast

import anyio

from pipeline.engine.arena import EngineArena
from pipeline.engine.spec import EngineProcessSpec
from pipeline.engine.wire import DECODER, Fatal, FrameReader, Ready, encode_command, frame
from pipeline.errors import EngineFailed

__all__ = ["EngineLink"]

# the child's sys.path is the parent's (argv[2:]), as multiprocessing would set it, before any import
_BOOTSTRAP = (
    "import sys; sys.path[:] = sys.argv[2:]; from pipeline.engine.process_main import main; main(int(sys.argv[1]))"
)
_STOP_WAIT_S = 10.0


def _spawn(fd: int, inherited: tuple[int, ...]) -> subprocess.Popen[bytes]:
    """Start an engine process whose end of the socket pair is descriptor ``fd``; it also inherits ``inherited``."""
    command = [sys.executable, "-c", _BOOTSTRAP, str(fd), *sys.path]
    return subprocess.Popen(command, pass_fds=(fd, *inherited), stdin=subprocess.DEVNULL)


class _Protocol(asyncio.Protocol):
    def __init__(self, link: EngineLink) -> None:
        self.link = link
        self.reader = FrameReader()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a cast, not an isinstance check: uvloop's transports (Ray Serve runs its replicas on
        # uvloop) are not registered with asyncio's transport classes
        self.link.connected(cast(asyncio.WriteTransport, transport))

    def data_received(self, data: bytes) -> None:
        for body in self.reader.feed(data):
            self.link.received(DECODER.decode(body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.lost()


class EngineLink:
    """One engine process; ``on_message`` gets its messages after ``Ready``, ``on_lost`` is called once
    if the socket closes after that (the process died or was killed). The process inherits ``arena``'s
    descriptor (its shared memory for adds' tensors: ``pipeline.engine.arena``)."""

    def __init__(
        self,
        spec: EngineProcessSpec,
        on_message: Callable[[Any], None],
        on_lost: Callable[[], None],
        arena: EngineArena | None = None,
    ) -> None:
        self.spec = spec
        self.arena = arena
        self._on_message = on_message
        self._on_lost = on_lost
        self._process: subprocess.Popen[bytes] | None = None
        self._transport: asyncio.WriteTransport | None = None
        self._ready = anyio.Event()
        self._fatal: str | None = None
        self.is_open = False  # ready, and the socket not closed
        self._telling: set[asyncio.Task[None]] = set()  # the task that tells the owner of a loss (kept alive)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def open(self, start_timeout_s: float, retry_after_s: float) -> None:
        """Start the process and wait until it has loaded the model.

        :raises EngineFailed: it reported an error, exited or did not start in time (it is reaped).
        """
        # started from the event loop's thread on purpose: the parent-death signal follows the thread
        # that started the process, and the loop's thread lives as long as the pipeline
        parent, child = socket.socketpair()
        try:
            inherited = (self.arena.slab.fd,) if self.arena is not None else ()
            self._process = _spawn(child.fileno(), inherited)  # ~10 ms on the loop, at start and after a failure
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        await asyncio.get_running_loop().create_unix_connection(lambda: _Protocol(self), sock=parent)
        arena_fd = self.arena.slab.fd if self.arena is not None else None  # the same number in the child
        self.write_frame(frame(pickle.dumps((os.getpid(), self.spec, arena_fd), protocol=pickle.HIGHEST_PROTOCOL)))
        with anyio.move_on_after(start_timeout_s) as waited:
            await self._ready.wait()
        if waited.cancelled_caught:
            self._fatal = f"it did not start in {start_timeout_s:g} s"
        if not self.is_open:
            why = self._fatal or f"it exited with code {self._process.poll()} while starting"
            await self.close(kill=True)
            raise EngineFailed(f"the engine process could not start: {why}", retry_after=retry_after_s, stage="engine")

    def write(self, command: tuple[Any, ...]) -> None:
        """Send one command (dropped once the socket has closed: the owner fails what it held)."""
        self.write_frame(encode_command(command))

    def write_frame(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def kill(self) -> None:
        """SIGKILL the process (its socket then closes)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()

    async def close(self, *, kill: bool) -> None:
        """Stop the process (``stop``, then SIGKILL after a grace period; at once with ``kill``) and reap it."""
        self.is_open = False
        process, self._process = self._process, None
        if process is not None:
            if kill and process.poll() is None:
                process.kill()
            elif not kill:
                self.write(("stop",))
            with anyio.CancelScope(shield=True):
                try:
                    await anyio.to_thread.run_sync(process.wait, _STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    # SIGKILL cannot be refused, but a process in uninterruptible I/O dies when it ends
                    process.kill()
                    await anyio.to_thread.run_sync(process.wait)
        if self._transport is not None:
            self._transport.close()

    def connected(self, transport: asyncio.WriteTransport) -> None:
        """The loop's end of the socket is open: commands are written through ``transport``."""
        self._transport = transport

    def received(self, message: Any) -> None:
        """One message from the process: ``Ready`` and ``Fatal`` are the link's, the rest its owner's."""
        if isinstance(message, Ready):
            self.is_open = True
            self._ready.set()
        elif isinstance(message, Fatal):
            self._fatal = message.message
        elif self.is_open:
            self._on_message(message)

    def lost(self) -> None:
        """The socket closed: the process died, was killed or stopped (called by the loop's protocol)."""
        self._transport = None
        self._ready.set()  # a start in progress sees that it failed
        if self.is_open:
            self.is_open = False
            # A protocol callback runs on the loop but outside any task, where anyio cannot tell which
            # library runs it (sniffio finds no current task): the owner's start_soon of a new engine
            # raised NoEventLoopError there, and no engine was ever started again. Told from a task,
            # the owner may use every anyio call.
            task = asyncio.get_running_loop().create_task(self._tell_lost())
            self._telling.add(task)
            task.add_done_callback(self._telling.discard)

    async def _tell_lost(self) -> None:
        self._on_lost()
