"""Over HTTP: a storm of clients that disconnect mid-stream, and ten times the capacity at once."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.released import assert_released
from tests.servers import serving


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=["thread", "process"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, Pipeline]]:
    """One server per engine mode for the module (tests read counters as differences). The bodies are
    text, so no preparation worker would run: threads it is."""
    config = PipelineConfig(
        max_pending_requests=16,
        stage_queue_size=16,
        max_running_seqs=8,
        num_kv_blocks=512,
        max_model_len=2048,
        preparation_mode="thread",
        engine_mode=request.param,
    )
    async with Pipeline(config) as pipe, serving(create_app(pipe), handler_cancellation=True) as base:
        yield base, pipe


async def _assert_nothing_left(pipe: Pipeline) -> None:
    await assert_released(pipe)
    assert all(s.queue_depth() == 0 and s.in_flight == 0 for s in pipe.metrics.stages.values())


async def test_disconnect_storm_releases_everything(served: tuple[str, Pipeline]) -> None:
    base, pipe = served
    rng = random.Random(7)
    seen: Counter[str] = Counter()

    async def client(i: int, read_lines: int) -> None:
        body = {
            "messages": [{"role": "user", "content": f"storm {i}"}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    seen[str(resp.status)] += 1
                    assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
                    return
                for _ in range(read_lines):
                    if not await resp.content.readline():
                        break
                seen["disconnected"] += 1
                resp.close()  # goes away mid-stream

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(client, i, rng.randrange(1, 30))
        await _assert_nothing_left(pipe)
    assert seen["disconnected"] + seen["429"] == 40 and seen["disconnected"] >= 16


async def test_ten_times_capacity_every_request_has_one_outcome(served: tuple[str, Pipeline]) -> None:
    base, pipe = served
    statuses: Counter[int] = Counter()
    before = dict(pipe.metrics.requests)

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        # Sampled at the default temperature: without ignore_eos a stop token may end an answer early.
        body = {"messages": [{"role": "user", "content": f"load {i}"}], "max_tokens": 4, "ignore_eos": True}
        async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
            payload = await resp.json()
            statuses[resp.status] += 1
            if resp.status == 429:
                assert resp.headers["Retry-After"] == "1" and payload["error"]["type"] == "overloaded"
            else:
                assert resp.status == 200 and payload["usage"]["completion_tokens"] == 4, json.dumps(payload)

    with anyio.fail_after(120):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async with anyio.create_task_group() as tg:
                for i in range(160):
                    tg.start_soon(client, i, session)
        await _assert_nothing_left(pipe)
    assert statuses[200] + statuses[429] == 160 and statuses[200] >= 16 and statuses[429] > 0
    requests = pipe.metrics.requests
    assert requests["completed"] - before.get("completed", 0) == statuses[200]
    assert requests["refused"] - before.get("refused", 0) == statuses[429]
