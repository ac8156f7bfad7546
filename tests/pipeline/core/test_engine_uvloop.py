"""The engine process serves a pipeline running on uvloop, as Ray Serve runs its replicas: uvloop's
transports are not registered with asyncio's transport classes, so nothing may assume they are."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from pipeline import Pipeline, PipelineConfig
from pipeline.engine.client import ProcessEngine

pytest.importorskip("uvloop")


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "asyncio", {"use_uvloop": True}


async def test_a_pipeline_on_uvloop_starts_its_engine_process_and_answers() -> None:
    config = PipelineConfig(
        engine_mode="process", preparation_mode="thread", max_running_seqs=2, num_kv_blocks=64, max_model_len=512
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}
    with anyio.fail_after(120):
        async with Pipeline(config) as pipe:
            assert isinstance(pipe.engine, ProcessEngine)
            result = await (await pipe.submit(body)).result()
    assert result.completion_tokens == 4
