"""AsyncEngine: the engine's step loop on its own thread, talking to the event loop through queues.

Commands (add, abort, stop) go in through a bounded thread-safe queue; each step's outputs come back
in one ``call_soon_threadsafe`` per step (not one per token), so the event loop does bookkeeping only.
The loop is asyncio's: the server (aiohttp) runs on asyncio.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from pipeline.types import Overloaded, PipelineError
from sampling.engine import LLMEngine
from sampling.inputs import EngineInput, SeqOutput

__all__ = ["AsyncEngine", "OutputStream"]

_STOP = object()


@dataclass(eq=False)
class OutputStream:
    """Outputs of one request, in order; ends when all ``n`` sequences have finished."""

    request_id: str
    n: int
    _items: deque[SeqOutput] = field(default_factory=deque)
    _wakeup: anyio.Event = field(default_factory=anyio.Event)
    _finished: int = 0
    error: PipelineError | None = None

    def push(self, output: SeqOutput) -> None:
        self._items.append(output)
        if output.finish_reason is not None:
            self._finished += 1
        self._wakeup.set()

    def fail(self, error: PipelineError) -> None:
        self.error = error
        self._finished = self.n
        self._wakeup.set()

    @property
    def is_finished(self) -> bool:
        return self._finished >= self.n

    async def __aiter__(self) -> AsyncIterator[SeqOutput]:
        while True:
            while self._items:
                yield self._items.popleft()
            if self.error is not None:
                raise self.error
            if self.is_finished:
                return
            self._wakeup = anyio.Event()
            await self._wakeup.wait()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, queue_size: int) -> None:
        self.engine = engine
        self._commands: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._streams: dict[str, OutputStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_steps = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def aclose(self) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)  # may wait for room: the loop drains the queue every step
        await anyio.to_thread.run_sync(self._thread.join)
        self._thread = None

    def submit(self, inp: EngineInput) -> OutputStream:
        """Queue ``inp``; its outputs arrive on the returned stream.

        :raises Overloaded: when the engine's command queue is full.
        """
        stream = OutputStream(inp.request_id, inp.sampling.n)
        try:
            self._commands.put_nowait(("add", inp))
        except queue.Full:
            raise Overloaded("the decode engine's queue is full", stage="engine") from None
        self._streams[inp.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Free the request's sequences at the next step (never blocks the loop)."""
        if self._streams.pop(request_id, None) is None:
            return
        try:
            self._commands.put_nowait(("abort", request_id))
        except queue.Full:  # an abort frees capacity, so it must not be lost: hand it to a thread
            threading.Thread(target=self._commands.put, args=(("abort", request_id),), daemon=True).start()

    async def barrier(self) -> None:
        """Return once the engine thread has handled every command queued before this call."""
        done = anyio.Event()
        await anyio.to_thread.run_sync(self._commands.put, ("barrier", done))
        await done.wait()

    @property
    def num_running(self) -> int:
        return len(self._streams)

    # -- on the engine thread ----------------------------------------------------------------
    def _handle(self, command: Any) -> bool:
        if command is _STOP:
            return False
        kind: str
        arg: Any
        kind, arg = command  # ("add", EngineInput) | ("abort", request_id)
        if kind == "add":
            self.engine.add(arg)
        elif kind == "abort":
            self.engine.abort(arg)
        elif kind == "barrier":
            assert self._loop is not None
            self._loop.call_soon_threadsafe(arg.set)
        return True

    def _run(self) -> None:
        running = True
        while running:
            try:
                block = not self.engine.has_work()
                while True:
                    command = self._commands.get(block=block)
                    block = False
                    if not self._handle(command):
                        running = False
                        break
            except queue.Empty:
                pass
            if not running:
                break
            outputs = self.engine.step()
            self.num_steps += 1
            if outputs:
                self._deliver_threadsafe(outputs)

    def _deliver_threadsafe(self, outputs: list[SeqOutput]) -> None:
        assert self._loop is not None
        deliver: Callable[[list[SeqOutput]], None] = self._deliver
        try:
            self._loop.call_soon_threadsafe(deliver, outputs)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    def _deliver(self, outputs: list[SeqOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.push(output)
            if stream.is_finished:
                del self._streams[output.request_id]
