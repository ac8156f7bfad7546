"""run_together: steps run at once; the first failure cancels the rest and is raised as itself."""

from __future__ import annotations

import anyio
import pytest

from pipeline.core.run_together import run_together


async def test_every_step_runs_to_its_end_together() -> None:
    first_waits = anyio.Event()
    done: list[str] = []

    async def first() -> None:
        await first_waits.wait()  # returns only because the second ran meanwhile
        done.append("first")

    async def second() -> None:
        first_waits.set()
        done.append("second")

    with anyio.fail_after(5):
        await run_together(first, second)
    assert done == ["second", "first"]


async def test_the_first_failure_cancels_the_others_and_is_raised_unwrapped() -> None:
    cancelled = anyio.Event()
    started = anyio.Event()

    async def waits_forever() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    async def fails() -> None:
        await started.wait()
        raise LookupError("the model")

    async def fails_later() -> None:
        await cancelled.wait()
        raise ValueError("after the first")  # raised while cancelled: not the one reported

    with anyio.fail_after(5), pytest.raises(LookupError, match="the model"):
        await run_together(waits_forever, fails, fails_later)
    assert cancelled.is_set()


async def test_a_cancellation_from_outside_propagates() -> None:
    with anyio.move_on_after(0.01) as scope:
        await run_together(anyio.sleep_forever, anyio.sleep_forever)
    assert scope.cancelled_caught


class Panic(BaseException):
    """Like pyo3's PanicException: a BaseException that is not an interrupt."""


async def test_a_base_exception_is_the_failure_too_and_a_later_one_does_not_replace_it() -> None:
    first_failed = anyio.Event()

    async def panics() -> None:
        raise Panic("native code")

    async def interrupted_while_cancelled() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            first_failed.set()
            raise KeyboardInterrupt  # raised while cancelled by the first failure: dropped

    with anyio.fail_after(5), pytest.raises(Panic, match="native code"):
        await run_together(interrupted_while_cancelled, panics)
    assert first_failed.is_set()
