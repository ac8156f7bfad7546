"""``assert_released``: the one "nothing left behind" check of the stress and fault tests."""

from __future__ import annotations

from pipeline import Pipeline


async def assert_released(pipe: Pipeline, *, drain_s: float = 30.0) -> None:
    """Wait for every admitted request to end, then assert the pipeline holds nothing: no pending
    job, no running handle or compile, no borrowed limiter token, no queued item, no engine request,
    output stream or KV block."""
    assert await pipe.drain(drain_s), "requests were still running"
    await pipe.wait_idle()
    if pipe.with_engine:
        await pipe.engine.barrier()  # the engine thread has handled every abort
    resources = pipe.resources()
    assert resources.is_released, resources
