"""AsyncEngine: the engine's step loop on its own thread, talking to the event loop through queues.

Commands (``Add``, ``Barrier``, ``Stop``) go in through a bounded thread-safe queue; an add waits for
room in it (``wait_room``: the engine thread wakes the waiters when it drains the queue, between steps)
rather than being refused. Aborts do not:
they go into a lock-protected set that the step loop drains before every step, so an abort never
blocks and never waits for room (a cancellation storm of hundreds of aborts costs a set insertion
each). An abort that overtakes its own ``Add`` in the queue marks the ``Add``, which is then
skipped. Each step's outputs come back in one ``call_soon_threadsafe`` per step (not one per
token), so the event loop does bookkeeping only. The loop is asyncio's: the server (aiohttp) runs
on asyncio. The commands and the output streams are ``sampling.commands``'s (the engine process's
client uses them too); they are named here as well.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

import anyio

from pipeline.errors import ShuttingDown
from sampling.command_room import CommandRoom
from sampling.commands import Add, Barrier, Command, EngineQueueFull, OutputStream, Stop, deliver
from sampling.engine import LLMEngine
from sampling.inputs import EngineInput, SeqOutput
from sampling.timeline import StepTiming, steps_since

__all__ = [
    "Add",
    "AsyncEngine",
    "Barrier",
    "EngineQueueFull",
    "OutputStream",
    "Stop",
    "decoding_stats",
    "deliver",
    "prefix_figures",
]


def decoding_stats(engine: LLMEngine) -> dict[str, int]:
    """Decoding now, for /health and /metrics (from another thread: a snapshot)."""
    scheduler = engine.scheduler
    allocator = scheduler.allocator
    return {
        "running_seqs": len(scheduler.running),
        "waiting_seqs": len(scheduler.waiting),
        "kv_blocks_used": allocator.num_blocks - allocator.num_free,
        "kv_blocks_total": allocator.num_blocks,
        "preemptions": scheduler.num_preemptions,
    }


def prefix_figures(engine: LLMEngine) -> dict[str, int] | None:
    """The KV prefix cache's counters and sizes; None when prefix caching is off."""
    scheduler = engine.scheduler
    if not scheduler.prefix_caching:
        return None
    allocator = scheduler.allocator
    kv = allocator.stats
    return {
        "hits": kv.hits,
        "misses": kv.misses,
        "evictions": kv.evictions,
        "blocks_held": kv.blocks_held,
        "num_blocks": allocator.num_blocks,
        "block_bytes": engine.runner.kv_block_bytes,
    }


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, queue_size: int) -> None:
        self.engine = engine
        self._commands: queue.Queue[Command] = queue.Queue(maxsize=queue_size)
        self._aborts: set[str] = set()
        self._aborts_lock = threading.Lock()
        # set on the event loop by a waiter that found the queue full, taken by the engine thread
        # once it has drained the queue: then it wakes the waiters (never otherwise: a loop wakeup per
        # step would cost the loop and the engine the GIL)
        self._room_wanted = False
        self._room_lock = threading.Lock()
        self.room = CommandRoom(self._has_room)
        self._streams: dict[str, OutputStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_steps = 0
        self.status = "ok"  # the engine thread cannot fail apart from the process (see ProcessEngine)

    @property
    def token_table(self) -> list[bytes]:
        """Each token id's bytes."""
        return self.engine.token_bytes.table

    def attach(self, tg: Any) -> None:
        """Nothing runs in the background for a thread engine (a process engine's watchdog does)."""

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def aclose(self) -> None:
        if self._thread is None:
            return
        self.room.fail(ShuttingDown("the decode engine stopped before this request reached it", stage="engine"))
        await anyio.to_thread.run_sync(self._commands.put, Stop())  # waits for room: the loop drains every step
        await anyio.to_thread.run_sync(self._thread.join)
        self._thread = None

    async def wait_room(self) -> None:
        """Return once the command queue has room for one add (first come first served); ``submit``
        before the next ``await``. Cancellable: a caller that leaves holds nothing here."""
        await self.room.wait()

    def _has_room(self) -> bool:
        # the check and the flag under one lock: the engine thread drains, then takes the flag under it
        with self._room_lock:
            if not self._commands.full():
                return True
            self._room_wanted = True
            return False

    def submit(self, inp: EngineInput) -> OutputStream:
        """Queue ``inp`` (``wait_room`` first); its outputs arrive on the returned stream.

        :raises EngineQueueFull: the command queue is full (the caller did not wait for room).
        """
        add = Add(inp)
        stream = OutputStream(add, inp.sampling.n)
        try:
            self._commands.put_nowait(add)
        except queue.Full:
            raise EngineQueueFull("the decode engine's queue is full") from None
        self._streams[inp.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Free the request's sequences before the next step (never blocks, never starts a thread)."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.add.is_aborted = True  # not yet handled: the engine thread skips it
        with self._aborts_lock:
            self._aborts.add(request_id)  # already in the engine: freed before the next step

    async def barrier(self) -> None:
        """Return once the engine thread has handled every command (and abort) queued before this call."""
        reached = anyio.Event()
        await anyio.to_thread.run_sync(self._commands.put, Barrier(reached))
        await reached.wait()

    async def step_timeline(self, since: float = 0.0) -> list[StepTiming]:
        """The engine's steps that began at ``since`` (``time.perf_counter()``) or later, with
        ``record_timeline`` (a snapshot: the engine thread appends meanwhile)."""
        return steps_since(self.engine.timeline, since)

    @property
    def num_running(self) -> int:
        return len(self._streams)

    def resources(self) -> dict[str, int]:
        """What the engine holds now (a snapshot for tests and metrics; read from another thread, so
        a step in progress may be half counted)."""
        allocator = self.engine.scheduler.allocator
        return {
            "engine_requests": self.engine.num_requests,
            "engine_streams": len(self._streams),
            "kv_blocks_used": allocator.num_blocks - allocator.num_free,
            "room_waiters": self.room.num_waiting,  # adds waiting for room in the command queue
        }

    def stats(self) -> dict[str, int]:
        """Decoding now, for /health and /metrics (read from another thread: a snapshot)."""
        return decoding_stats(self.engine)

    def prefix_cache_figures(self) -> dict[str, int] | None:
        """The KV prefix cache's counters (None: off); read from another thread, a snapshot."""
        return prefix_figures(self.engine)

    # -- on the engine thread ----------------------------------------------------------------
    def _drain_aborts(self) -> None:
        with self._aborts_lock:
            aborts, self._aborts = self._aborts, set()
        for request_id in aborts:
            self.engine.abort(request_id)  # a no-op for a request that finished or was never added

    def _handle(self, command: Command) -> bool:
        """Apply one command; False for ``Stop``."""
        if isinstance(command, Stop):
            return False
        if isinstance(command, Add):
            if not command.is_aborted:
                self.engine.add(command.inp)
        elif isinstance(command, Barrier):
            self._drain_aborts()
            self._call_on_loop(command.reached.set)
        return True

    def _next_command(self, block: bool) -> Command | None:
        # Idle, the loop sleeps on the queue: an abort then has nothing in the engine to free (an Add
        # still queued is marked instead), so it need not wake the loop.
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None

    def _run(self) -> None:
        while True:
            command = self._next_command(block=not self.engine.has_work())
            while command is not None:
                if not self._handle(command):
                    return
                command = self._next_command(block=False)
            self._room_made()
            self._drain_aborts()
            if not self.engine.has_work():
                continue
            outputs = self.engine.step()
            self.num_steps += 1
            if outputs:
                self._call_on_loop(self._deliver, outputs)

    def _room_made(self) -> None:
        """The queue is drained: wake the adds waiting for room, if any wait."""
        with self._room_lock:
            wanted, self._room_wanted = self._room_wanted, False
        if wanted:
            self._call_on_loop(self.room.notify)

    def _call_on_loop(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    def _deliver(self, outputs: list[SeqOutput]) -> None:
        deliver(self._streams, outputs)
