"""Over HTTP, a storm of hostile bodies at once: bodies that stall (10 bytes of a ``Content-Length``,
a chunk promising 2 GiB), compressed bodies 1,000 times larger inflated than sent, and bombs over the
body limit. Each is answered (408, 400, 413, or 503 with ``Retry-After`` when the inflate budget is
spent), ``/health`` answers meanwhile, and afterwards every connection, body slot and byte of the
budget is given back and the pipeline holds nothing."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import pytest
from aiohttp import web

from pipeline import PipelineConfig
from pipeline.api import body_pacing
from pipeline.api.connections import ConnectionLimits
from pipeline.api.listener import Listener, listen
from pipeline.api.request_body import INFLATE_KEY
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.rawhttp import RawResponse, address, exchange, read_response, request_bytes
from tests.released import assert_released

MIB = 1024 * 1024
LIMITS = ConnectionLimits(
    max_connections=256, reserved_connections=8, body_timeout_s=1.5, body_timeout_rate=64 * 1024, log_interval_s=3600
)
# a stalled body holds a body slot until the pacer's first rate check gives it up; the bodies queued
# behind the storm's stalled ones wait that long per stalled body ahead, their deadlines running
PACER_CHECK_S = 0.01
JSON: dict[str, bytes | str] = {"Content-Type": "application/json"}
GZIP: dict[str, bytes | str] = {**JSON, "Content-Encoding": "gzip"}
NUM_STALLED, NUM_COMPRESSED, NUM_BOMBS = 48, 24, 4


@dataclass
class Served:
    pipe: Pipeline
    app: web.Application
    listener: Listener


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[Served]:
    config = PipelineConfig(
        max_running_seqs=2, num_kv_blocks=64, max_model_len=512, preparation_mode="thread", engine_mode="thread"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(body_pacing, "CHECK_S", PACER_CHECK_S)
        async with Pipeline(config, with_engine=False) as pipe:  # every body here is answered before the engine
            app = create_app(pipe, max_body_bytes=4 * MIB, max_inflating_bytes=8 * MIB)
            async with listen(app, limits=LIMITS) as listener:
                yield Served(pipe, app, listener)


async def until(condition: Callable[[], bool]) -> None:
    """Return once ``condition()`` holds (the server closes in its transports' callbacks on this
    loop; the caller's ``fail_after`` bounds the wait)."""
    while not condition():
        await anyio.lowlevel.checkpoint()  # noqa: ASYNC110


async def stall(listener: Listener, i: int) -> int:
    """A head and a few bytes of its body, then nothing: the server's answer's status."""
    if i % 2:
        headers, sent = {**JSON, "Transfer-Encoding": "chunked"}, b"80000000\r\n" + b"x" * 1024
    else:
        headers, sent = {**JSON, "Content-Length": "1000"}, b'{"messages'
    host, port = address(listener.url)
    async with await anyio.connect_tcp(host, port) as stream:
        await stream.send(request_bytes("POST", "/v1/chat/completions", headers) + sent)
        return (await read_response(stream)).status


async def test_a_storm_of_stalled_and_compressed_bodies_is_answered_and_leaves_nothing(served: Served) -> None:
    listener, budget = served.listener, served.app[INFLATE_KEY]
    url = listener.url
    large = gzip.compress(json.dumps({"messages": "not a list", "padding": "a" * (3 * MIB)}).encode())  # 3 KiB sent
    bomb = gzip.compress(b'{"messages": "' + b"a" * (64 * MIB) + b'"}')
    statuses: Counter[str] = Counter()
    answers: list[RawResponse] = []

    async def stalled(i: int) -> None:
        statuses[f"stalled {await stall(listener, i)}"] += 1

    async def post(kind: str, body: bytes) -> None:
        answer = await exchange(url, request_bytes("POST", "/v1/chat/completions", GZIP, body))
        statuses[f"{kind} {answer.status}"] += 1
        answers.append(answer)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(NUM_STALLED):
                tg.start_soon(stalled, i)
            for _ in range(NUM_COMPRESSED):
                tg.start_soon(post, "compressed", large)
            for _ in range(NUM_BOMBS):
                tg.start_soon(post, "bomb", bomb)
            health = await exchange(url, request_bytes("GET", "/health", {}))
        await until(lambda: listener.guard.num_open == 0)
        await assert_released(served.pipe)
    assert health.status == 200
    assert statuses["stalled 408"] == NUM_STALLED, statuses
    assert statuses["bomb 413"] + statuses["bomb 503"] == NUM_BOMBS, statuses
    assert statuses["compressed 400"] + statuses["compressed 503"] == NUM_COMPRESSED, statuses
    for answer in answers:
        error = answer.json()["error"]
        assert error["message"] and error["param"], error
        if answer.status == 503:
            assert int(answer.headers["retry-after"]) >= 1 and error["code"] == "overloaded"
    assert budget.held == 0 and budget.stats.most_held <= budget.max_bytes
    assert listener.bodies.num_reading == 0 and listener.bodies.num_waiting == 0
    assert listener.guard.stats.body_timeouts >= NUM_STALLED
