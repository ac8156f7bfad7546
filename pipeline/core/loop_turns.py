"""LoopTurns: the serving process's longer synchronous steps on the event loop run one per iteration."""

from __future__ import annotations

import anyio

__all__ = ["LoopTurns"]


class LoopTurns:
    """One turn at a time, in arrival order, for a step that holds the event loop for 0.1-0.4 ms.

    The steps are a body's parse and admission (``pipeline.api.routes``), an engine input's wrapping
    and submission (``Preparation.prepared``) and a reply's encoding. A burst makes a hundred of them
    ready at once, and the loop runs every ready step before it polls again, so /health waited for
    all of them; with one turn, the loop polls between any two. A step takes the turn just before its
    synchronous part and gives it back at its end: the next waiter resumes in the next iteration. A
    step that will not do that work (a request that already failed) takes no turn.
    """

    def __init__(self) -> None:
        # anyio's limiter wakes its waiters in arrival order; the pipeline lists it with the stage
        # limiters, so a turn held after the requests ended shows in the leak checks
        self.limiter = anyio.CapacityLimiter(1)

    async def acquire(self) -> None:
        """Wait for the turn (a cancelled waiter holds nothing)."""
        await self.limiter.acquire()

    def release(self) -> None:
        """Give the turn to the next waiter."""
        self.limiter.release()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()
