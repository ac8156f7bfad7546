"""run_together: start steps concurrently and raise the first failure as itself.

A task group raises its children's failures as an exception group; a pipeline's start raises typed
errors (``UnsupportedModel``, ``EngineFailed``) that its callers catch by type, so the first failure
cancels the other steps and is raised unwrapped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

__all__ = ["run_together"]


async def run_together(*steps: Callable[[], Awaitable[object]]) -> None:
    """Run ``steps`` concurrently until all return; the first to raise cancels the rest, and its
    exception is raised once they have stopped (what the others raise meanwhile is dropped: the
    first is the cause). Cancellation from outside propagates as usual."""
    failed: list[BaseException] = []
    cancelled = anyio.get_cancelled_exc_class()

    async def run(step: Callable[[], Awaitable[object]]) -> None:
        try:
            await step()
        except cancelled:
            raise
        except BaseException as exc:  # a native panic (pyo3's PanicException) or an interrupt too
            if not failed:
                failed.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for step in steps:
            tg.start_soon(run, step)
    if failed:
        raise failed[0]
