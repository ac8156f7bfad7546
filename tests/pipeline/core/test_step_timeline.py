"""The engine's step timeline as the benchmarks fetch it, from the engine thread or the engine process."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=["thread", "process"])
async def pipe(request: pytest.FixtureRequest) -> AsyncIterator[Pipeline]:
    config = PipelineConfig(
        max_running_seqs=4, num_kv_blocks=128, max_model_len=1024, engine_mode=request.param, record_step_timeline=True
    )
    async with Pipeline(config) as p:
        yield p


async def test_the_steps_since_a_time_are_those_of_the_requests_after_it(pipe: Pipeline) -> None:
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    await (await pipe.submit(body)).result()
    since = time.perf_counter()  # the engine process's clock is the same one
    result = await (await pipe.submit(body | {"max_tokens": 4})).result()
    steps = await pipe.engine.step_timeline(since)
    num_prompt = result.prompt_tokens
    # the prompt in one chunk (sampling the first token), then a decode of one for each other token
    assert [(t.kind, t.batch) for t in steps] == [("prefill", 1)] + [("decode", 1)] * 3
    assert steps[0].tokens <= num_prompt and all(t.tokens == 1 for t in steps[1:])
    assert all(since <= t.start and t.total > 0 for t in steps)


async def test_without_recording_there_is_no_timeline() -> None:
    async with Pipeline(PipelineConfig(max_running_seqs=2, num_kv_blocks=64, max_model_len=1024)) as p:
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 2, "temperature": 0}
        await (await p.submit(body)).result()
        assert await p.engine.step_timeline() == []
