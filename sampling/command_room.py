"""CommandRoom: requests wait, first come first served, for room in an engine's bounded command queue.

The engine's command queue (``engine_queue_size``) bounds what is in flight to the engine, not what the
pipeline admits: a prepared request that finds it full waits here rather than being refused (admission,
which counts the waiters, is where a full pipeline refuses). The engine front-end says when room may
have come (``notify``: an engine thread that drained its queue, an engine process's acknowledgement of
commands read) and fails the waiters when its engine is lost (``fail``).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable

import anyio

__all__ = ["CommandRoom"]


class _Waiter:
    __slots__ = ("error", "woken")

    def __init__(self) -> None:
        self.woken = anyio.Event()
        self.error: BaseException | None = None


class CommandRoom:
    """FIFO waiters for room in one command queue; ``has_room`` is asked on the event loop.

    ``has_room()`` returns whether one more command fits now; when it returns False it must see to it
    that ``notify()`` is called once room may have come (after the engine next reads commands).
    """

    def __init__(self, has_room: Callable[[], bool]) -> None:
        self._has_room = has_room
        self._waiters: deque[_Waiter] = deque()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for room now."""
        return len(self._waiters)

    async def wait(self) -> None:
        """Return once one more command fits (at once, without yielding, when it fits and nobody
        waits); the caller sends it before its next ``await``. Cancellation leaves the queue.

        :raises BaseException: the error ``fail`` gave while this call waited.
        """
        if not self._waiters and self._has_room():
            return
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            while not (self._waiters[0] is waiter and self._has_room()):
                await waiter.woken.wait()
                if waiter.error is not None:
                    raise copy.copy(waiter.error)  # each its own: its request binds its id to it
                waiter.woken = anyio.Event()
        finally:
            self._waiters.remove(waiter)
            # the next in line looks for room once this caller has sent its command (or left)
            self.notify()

    def notify(self) -> None:
        """Room may have come: the first waiter looks (on the event loop)."""
        if self._waiters:
            self._waiters[0].woken.set()

    def fail(self, error: BaseException) -> None:
        """Every request waiting now gets ``error`` (its engine is lost); later callers wait as usual."""
        for waiter in self._waiters:
            if waiter.error is None:
                waiter.error = error
                waiter.woken.set()
