"""Request bodies read a few at a time, so that a burst's bodies spread over loop iterations and
``/health`` is answered between them.

A burst of large requests arriving together (128 chat requests, half with 595 KB of base64 image)
had the event loop read all of their bodies in one or two iterations: 60-150 callbacks, 7-26 ms
each, and a ``/health`` probe waited behind them. Here at most ``max_reading`` bodies are read at
once. A handler that wants to read a body beyond that waits for a slot, first come first served,
with its connection's reading paused; and until its body is read, a read from a connection takes at
most ``HEAD_READ_BYTES`` (its request head and a little more), so a burst's arrival reads heads, not
bodies. A request without a body (``GET /health``) never waits.

A slot is kept while its body arrives faster than ``min_rate`` bytes a second (checked every
``CHECK_S``): a client that sends its body slowly reads on without one, so slow or stalling clients
(a slowloris) cannot hold the slots, and their reads, a trickle, make no burst anyway. Waiting costs
a client little: its data goes on arriving into the socket's buffer meanwhile, and is read at once
when its turn comes.

``HEAD_READ_BYTES`` sets the size of one ``recv`` of asyncio's selector transport (its ``max_size``);
another event loop's transport (uvloop) reads as it does, and the slots still pace the bodies.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import StreamReader, web

__all__ = ["HEAD_READ_BYTES", "BodyPacer", "PacingStats", "read_heads"]

# one read of a connection whose body is not being read (asyncio reads 256 KiB otherwise)
HEAD_READ_BYTES = 16 * 1024
_BODY_READ_BYTES = 256 * 1024  # asyncio's own size, for a body being read
CHECK_S = 0.05  # how often a slot's body is checked for its rate


def read_heads(transport: asyncio.BaseTransport) -> None:
    """Make each read of ``transport`` at most ``HEAD_READ_BYTES`` (a no-op for transports without the knob)."""
    _set_read_size(transport, HEAD_READ_BYTES)


def _set_read_size(transport: asyncio.BaseTransport, size: int) -> None:
    if hasattr(transport, "max_size"):
        transport.max_size = size  # type: ignore[attr-defined]


@dataclass(slots=True)
class PacingStats:
    """What the pacer did since the server started."""

    bodies: int = 0  # read under a slot
    waited: int = 0  # of those, waited for their slot
    slow: int = 0  # slots given up by bodies that arrived slower than min_rate
    most_reading: int = 0  # the most bodies read at once


@dataclass(eq=False, slots=True)
class _Slot:
    content: StreamReader
    seen: int = 0  # the body's bytes received at the last check
    timer: asyncio.TimerHandle | None = None
    held: bool = True


class BodyPacer:
    """At most ``max_reading`` request bodies read at once, a slot kept while its body arrives at
    ``min_rate`` bytes a second or faster. Event loop only."""

    def __init__(self, max_reading: int, min_rate: float) -> None:
        if max_reading < 1:
            raise ValueError(f"max_reading must be at least 1, got {max_reading}")
        if not min_rate > 0:
            raise ValueError(f"min_rate must be positive, got {min_rate}")
        self.max_reading = max_reading
        self.min_rate = min_rate
        self.stats = PacingStats()
        self._reading = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def num_reading(self) -> int:
        return self._reading

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    async def read(self, request: web.BaseRequest) -> bytes:
        """``request``'s body, read under a slot (a request without one is read at once)."""
        async with self.slot(request):
            return await request.read()

    @asynccontextmanager
    async def slot(self, request: web.BaseRequest) -> AsyncIterator[None]:
        """Hold a slot to read ``request``'s body in for the block (none for a request without a body)."""
        transport = request.transport
        if not request.body_exists or transport is None:
            yield
            return
        slot = await self._acquire(transport, request.content)
        try:
            _set_read_size(transport, _BODY_READ_BYTES)
            yield
        finally:
            self._release(slot)
            read_heads(transport)  # the next request on this connection starts with its head

    async def _acquire(self, transport: asyncio.BaseTransport, content: StreamReader) -> _Slot:
        if self._reading >= self.max_reading or self._waiters:
            self.stats.waited += 1
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            paused = _pause(transport)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # a slot was given as it was cancelled
                    self._reading -= 1
                    self._wake_next()
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise
            finally:
                if paused is not None and not paused.is_closing():
                    paused.resume_reading()
        else:
            self._reading += 1
        stats = self.stats
        stats.bodies += 1
        stats.most_reading = max(stats.most_reading, self._reading)
        slot = _Slot(content, content.total_bytes)
        slot.timer = asyncio.get_running_loop().call_later(CHECK_S, self._check, slot)
        return slot

    def _check(self, slot: _Slot) -> None:
        """Keep the slot while its body arrives at ``min_rate`` or faster; a slower one reads on without it."""
        if not slot.held:
            return
        total = slot.content.total_bytes
        if total - slot.seen < self.min_rate * CHECK_S:
            self.stats.slow += 1
            self._release(slot)
            return
        slot.seen = total
        slot.timer = asyncio.get_running_loop().call_later(CHECK_S, self._check, slot)

    def _release(self, slot: _Slot) -> None:
        if not slot.held:
            return
        slot.held = False
        if slot.timer is not None:
            slot.timer.cancel()
        self._reading -= 1
        self._wake_next()

    def _wake_next(self) -> None:
        """Hand a free slot to the longest waiter (it resumes in the next iteration)."""
        while self._reading < self.max_reading and self._waiters:
            waiter = self._waiters.popleft()
            if waiter.done():  # cancelled
                continue
            self._reading += 1
            waiter.set_result(None)


def _pause(transport: asyncio.BaseTransport) -> asyncio.ReadTransport | None:
    """Pause ``transport``'s reading: itself when this call paused it, None when it was not reading."""
    if not isinstance(transport, asyncio.ReadTransport) or not transport.is_reading():
        return None
    transport.pause_reading()
    return transport
