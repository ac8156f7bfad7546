"""Request bodies over real sockets: a stalled body is answered 408 and its connection closed; a
compressed body is inflated under the budget (413 past the body limit, 503 when the budget is
spent, everything given back); a body refused from its head alone is never read."""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import pytest
from aiohttp import web

from pipeline import PipelineConfig
from pipeline.api.connections import ConnectionLimits
from pipeline.api.inflate import InflateBudget
from pipeline.api.listener import Listener, listen
from pipeline.api.request_body import INFLATE_KEY
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.rawhttp import RawResponse, address, exchange, read_response, request_bytes

MIB = 1024 * 1024
BODY_LIMIT = 4 * MIB
LIMITS = ConnectionLimits(body_timeout_s=0.5, body_timeout_rate=64 * 1024, log_interval_s=3600)
JSON = {"Content-Type": "application/json"}
GZIP = {**JSON, "Content-Encoding": "gzip"}
# read and parsed whole, then refused by its one bad field: no engine is needed to answer it
CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 9}).encode()


@dataclass
class Server:
    app: web.Application
    listener: Listener

    @property
    def budget(self) -> InflateBudget:
        return self.app[INFLATE_KEY]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[Server]:
    config = PipelineConfig(
        max_running_seqs=2, num_kv_blocks=64, max_model_len=512, preparation_mode="thread", engine_mode="thread"
    )
    async with Pipeline(config, with_engine=False) as pipe:
        app = create_app(pipe, max_body_bytes=BODY_LIMIT, max_inflating_bytes=2 * BODY_LIMIT)
        async with listen(app, limits=LIMITS) as listener:
            yield Server(app, listener)


async def until(condition: Callable[[], bool]) -> None:
    """Return once ``condition()`` holds (the server closes in its transports' callbacks on this
    loop; the caller's ``fail_after`` bounds the wait)."""
    while not condition():
        await anyio.lowlevel.checkpoint()  # noqa: ASYNC110


async def post(server: Server, headers: dict[str, bytes | str], body: bytes) -> RawResponse:
    return await exchange(server.listener.url, request_bytes("POST", "/v1/chat/completions", headers, body))


def assert_error(answer: RawResponse, status: int, field: str | None) -> dict[str, object]:
    assert answer.status == status, answer
    error: dict[str, object] = answer.json()["error"]
    assert error["param"] == field and error["message"], error
    return error


# -- the body deadline ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("headers", "sent"),
    [
        ({"Content-Length": "1000"}, b'{"messages'),  # 10 of 1,000 bytes, then nothing
        ({"Transfer-Encoding": "chunked"}, b"80000000\r\n" + b"x" * 1024),  # a 2 GiB chunk promised, 1 KiB sent
    ],
)
async def test_a_stalled_body_is_answered_408_and_its_connection_closed(
    server: Server, headers: dict[str, str], sent: bytes
) -> None:
    guard = server.listener.guard
    timeouts = guard.stats.body_timeouts
    host, port = address(server.listener.url)
    with anyio.fail_after(20):
        async with await anyio.connect_tcp(host, port) as stream:
            await stream.send(request_bytes("POST", "/v1/chat/completions", {**JSON, **headers}) + sent)
            answer = await read_response(stream)
            assert answer.headers["connection"] == "close"
            await until(lambda: guard.stats.body_timeouts > timeouts and guard.num_open == 0)  # its slot is back
    assert_error(answer, 408, "body")
    assert guard.stats.body_timeouts == timeouts + 1
    assert server.listener.bodies.num_reading == 0
    assert (await exchange(server.listener.url, request_bytes("GET", "/health", {}))).status == 200


# -- compressed bodies ------------------------------------------------------------------------
async def test_a_compressed_request_is_read_whole_and_gives_its_budget_back(server: Server) -> None:
    inflated = server.budget.stats.inflated
    with anyio.fail_after(30):
        answer = await post(server, GZIP, gzip.compress(CHAT))
    assert_error(answer, 400, "temperature")  # its JSON was read: the one bad field is named
    assert server.budget.stats.inflated == inflated + 1 and server.budget.held == 0


async def test_a_bomb_is_refused_413_having_inflated_no_more_than_the_limit(server: Server) -> None:
    bomb = gzip.compress(b'{"messages": "' + b"a" * (64 * MIB) + b'"}')  # 64 KiB inflating to 64 MiB
    with anyio.fail_after(30):
        answer = await post(server, GZIP, bomb)
    assert_error(answer, 413, "body")
    assert server.budget.held == 0 and server.budget.stats.most_held <= BODY_LIMIT


async def test_a_spent_budget_is_a_503_with_retry_after_until_it_is_given_back(server: Server) -> None:
    budget = server.budget
    holder = budget.lease()  # as other requests' bodies would hold it
    holder.take(budget.max_bytes - 1024)
    try:
        with anyio.fail_after(30):
            answer = await post(server, GZIP, gzip.compress(CHAT + b" " * 4096))
        error = assert_error(answer, 503, "Content-Encoding")
        assert error["code"] == "overloaded" and int(answer.headers["retry-after"]) >= 1
    finally:
        holder.release()
    with anyio.fail_after(30):
        assert_error(await post(server, GZIP, gzip.compress(CHAT + b" " * 4096)), 400, "temperature")
    assert budget.held == 0


# -- refused from the head alone --------------------------------------------------------------
async def test_a_content_length_over_the_limit_is_refused_before_its_body_is_sent(server: Server) -> None:
    host, port = address(server.listener.url)
    with anyio.fail_after(20):
        async with await anyio.connect_tcp(host, port) as stream:
            await stream.send(request_bytes("POST", "/v1/chat/completions", {**JSON, "Content-Length": "10000000000"}))
            answer = await read_response(stream)  # no byte of the body sent
    assert_error(answer, 413, "body")
    assert answer.headers["connection"] == "close"
