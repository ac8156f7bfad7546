"""LoopTurns: the serving process's longer synchronous steps on the event loop run one per iteration."""

from __future__ import annotations

from typing import Any

import anyio

from pipeline.outcome import Outcome

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

    async def acquire_unless_failed(self, outcome: Outcome[Any]) -> BaseException | None:
        """Wait for the turn, or for ``outcome`` to fail if it does first: None with the turn held,
        else ``outcome``'s error with nothing held (a request whose compile is refused while it
        waits ends at once, taking no turn)."""
        held = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await outcome.wait()
                if outcome.error is not None and not held:
                    tg.cancel_scope.cancel()  # its acquire is cancelled: a cancelled waiter holds nothing

            tg.start_soon(watch)
            await self.acquire()
            held = True
            tg.cancel_scope.cancel()  # the watch is not needed any more
        return None if held else outcome.error

    def release(self) -> None:
        """Give the turn to the next waiter."""
        self.limiter.release()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()
