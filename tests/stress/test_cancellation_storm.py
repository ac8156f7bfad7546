"""200 requests cancelled at seeded random points: nothing stays borrowed, queued or running."""

from __future__ import annotations

import os
import random

import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.errors import PipelineError
from tests.images import data_url, encode, image_request, make_image
from tests.released import assert_released

NUM_REQUESTS = 200


def storm_body(i: int, images: list[str]) -> dict[str, object]:
    body = image_request(images[: i % 3], text=f"request {i}")
    if i % 4 == 0:  # a distinct schema each time: real compiles, not cache hits
        schema = {"type": "object", "properties": {f"v{i}": {"type": "string", "maxLength": 8}}, "required": [f"v{i}"]}
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    return body


@pytest.mark.parametrize("mode", ["process", "thread"])
async def test_cancellation_storm_leaves_nothing_behind(mode: str) -> None:
    rng = random.Random(1234)
    images = [data_url(encode(make_image(256, 192, seed=s), "JPEG"), "image/jpeg") for s in range(2)]
    config = PipelineConfig(max_pending_requests=NUM_REQUESTS, stage_queue_size=NUM_REQUESTS, preparation_mode=mode)
    shm_before = set(os.listdir("/dev/shm"))
    outcomes: dict[str, int] = {"completed": 0, "cancelled": 0, "failed": 0}

    async with Pipeline(config, with_engine=False) as pipe:

        async def one(i: int, cancel_after: int | None) -> None:
            with anyio.CancelScope() as scope:

                async def canceller() -> None:
                    if cancel_after is None:
                        return
                    for _ in range(cancel_after):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(canceller)
                    try:
                        await pipe.prepare(storm_body(i, images))
                        outcomes["completed"] += 1
                    except PipelineError:
                        outcomes["failed"] += 1
                    tg.cancel_scope.cancel()
            if scope.cancelled_caught:
                outcomes["cancelled"] += 1

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(NUM_REQUESTS):
                    # a third run to the end; the rest are cancelled after 0..2000 loop iterations
                    tg.start_soon(one, i, None if i % 3 == 0 else rng.randrange(0, 2000))
            await pipe.wait_idle()

        assert sum(outcomes.values()) == NUM_REQUESTS
        assert outcomes["cancelled"] > 20 and outcomes["completed"] >= NUM_REQUESTS // 3
        assert outcomes["failed"] == 0
        await assert_released(pipe)
        # every admitted job left the stages with exactly one outcome
        left = pipe.metrics.jobs
        assert left["completed"] + left["cancelled"] + left["failed"] == NUM_REQUESTS
        # a caller may be cancelled after its job left the last stage (while joining the grammar):
        # then the job counts as completed and the caller as cancelled, never the other way round
        assert left["completed"] >= outcomes["completed"] and left["cancelled"] <= outcomes["cancelled"]
        pool = pipe.preparation.pool
        assert (pool is not None) == (mode == "process")
        if pool is not None:  # cancelled jobs' workers finished them: none was killed or died
            assert pool.stats.crashes == pool.stats.timeouts == 0 and pool.limiter.borrowed_tokens == 0
    assert set(os.listdir("/dev/shm")) == shm_before
