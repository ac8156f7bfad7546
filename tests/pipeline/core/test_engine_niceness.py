"""The engine process runs at the configured niceness, and a niceness out of range is refused."""

from __future__ import annotations

import os

import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.engine.client import ProcessEngine


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_the_engine_process_runs_at_the_configured_niceness() -> None:
    # lowered, not raised: raising needs a privilege the test may not have
    nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)
    config = PipelineConfig(
        engine_mode="process", preparation_mode="thread", engine_process_nice=nice, num_kv_blocks=64, max_model_len=512
    )
    async with Pipeline(config) as pipe:
        engine = pipe.engine
        assert isinstance(engine, ProcessEngine) and engine.pid is not None
        assert os.getpriority(os.PRIO_PROCESS, engine.pid) == nice
        handle = await pipe.submit({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert (await handle.result()) is not None


@pytest.mark.parametrize("nice", [-21, 20])
def test_a_niceness_out_of_range_is_refused(nice: int) -> None:
    with pytest.raises(ValueError, match="engine_process_nice"):
        PipelineConfig(engine_process_nice=nice)
