"""Two ways to wait for work done elsewhere: ``Outcome[T]`` (one result or one error, set once) and
``Mailbox[T]`` (items in order until closed, then an error or the end).

Import-free but for anyio, so the lower layers may use it (``make check`` enforces it).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

import anyio

__all__ = ["Mailbox", "Outcome", "OutcomeState"]

T = TypeVar("T")


class OutcomeState(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Outcome(Generic[T]):
    """One result or one error, set once; any number of tasks wait for it.

    The first ``set_result``/``fail``/``cancel`` wins and later ones are ignored, so racing
    producers (a stage failing a job while its requester cancels it) end it exactly once.
    """

    __slots__ = ("_done", "_error", "_result", "state")

    def __init__(self) -> None:
        self.state = OutcomeState.PENDING
        self._result: T | None = None
        self._error: BaseException | None = None
        self._done = anyio.Event()

    @property
    def is_done(self) -> bool:
        return self.state is not OutcomeState.PENDING

    @property
    def error(self) -> BaseException | None:
        return self._error

    def set_result(self, result: T) -> bool:
        """Complete with ``result``; False when the outcome was already set."""
        return self._end(OutcomeState.COMPLETED, result, None)

    def fail(self, error: BaseException) -> bool:
        return self._end(OutcomeState.FAILED, None, error)

    def cancel(self, error: BaseException) -> bool:
        return self._end(OutcomeState.CANCELLED, None, error)

    def _end(self, state: OutcomeState, result: T | None, error: BaseException | None) -> bool:
        if self.state is not OutcomeState.PENDING:
            return False
        self.state, self._result, self._error = state, result, error
        self._done.set()
        return True

    async def wait(self) -> None:
        """Return once the outcome is set (whatever it is)."""
        await self._done.wait()

    def get(self) -> T:
        """The result of a set outcome. :raises: its error."""
        if self.state is OutcomeState.PENDING:
            raise RuntimeError("the outcome is not set yet")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    async def result(self) -> T:
        """Wait, then the result. :raises: the outcome's error."""
        await self._done.wait()
        return self.get()


class Mailbox(Generic[T]):
    """Items in arrival order for one reader, then the end: closed cleanly or with an error.

    ``put`` never blocks (the producer bounds what it puts: ``max_tokens * n`` deltas at most), so
    an engine thread delivering through ``call_soon_threadsafe`` can never stall on a slow reader.
    """

    __slots__ = ("_closed", "_error", "_items", "_wakeup")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._wakeup = anyio.Event()
        self._closed = False
        self._error: BaseException | None = None

    def put(self, item: T) -> None:
        if self._closed:
            return  # late items after an abort or failure are dropped
        self._items.append(item)
        self._wakeup.set()

    def close(self, error: BaseException | None = None) -> None:
        """No more items; a reader gets those queued, then ``error`` raised (or the end)."""
        if not self._closed:
            self._closed, self._error = True, error
            self._wakeup.set()

    @property
    def is_closed(self) -> bool:
        return self._closed

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        while True:
            while self._items:
                yield self._items.popleft()
            if self._closed:
                if self._error is not None:
                    raise self._error
                return
            self._wakeup = anyio.Event()
            await self._wakeup.wait()
