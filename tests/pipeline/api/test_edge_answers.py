"""HTTP's edge cases answered as the anchors (OpenAI's API, vLLM) answer them, each in OpenAI's JSON
error shape in our words: heads over the parser's limits (431, 414), expectations (417, and no
``100 Continue`` for a body that will be refused), and ``stream_options`` without ``stream``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.api.connections import ConnectionLimits
from pipeline.api.listener import Listener, listen
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.rawhttp import RawResponse, address, exchange, read_response, request_bytes

JSON: dict[str, bytes | str] = {"Content-Type": "application/json"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def listener() -> AsyncIterator[Listener]:
    config = PipelineConfig(
        max_running_seqs=2, num_kv_blocks=64, max_model_len=512, preparation_mode="thread", engine_mode="thread"
    )
    limits = ConnectionLimits(log_interval_s=3600)
    # no engine: every request here is answered before one would be needed
    async with Pipeline(config, with_engine=False) as pipe:
        async with listen(create_app(pipe, max_body_bytes=1 << 20), limits=limits) as served:
            yield served


def assert_json_error(answer: RawResponse, status: int, field: str) -> str:
    assert answer.status == status, answer
    assert answer.headers["content-type"].startswith("application/json"), answer
    error = answer.json()["error"]
    assert error["param"] == field and error["message"], error
    return str(error["message"])


async def receive_all(listener: Listener, raw: bytes) -> bytes:
    """Everything the server sends to ``raw`` (a head and no body) until it closes."""
    host, port = address(listener.url)
    data = b""
    async with await anyio.connect_tcp(host, port) as stream:
        await stream.send(raw)
        while True:
            try:
                data += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return data


# -- heads over the parser's limits -----------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "headers", "status", "field"),
    [
        ("/v1/chat/completions", {f"X-H{i}": "v" for i in range(10_000)}, 431, "headers"),
        ("/v1/chat/completions", {"X-Big": "a" * 100_000}, 431, "headers"),
        ("/v1/chat/completions", {"Host": "a" * 100_000}, 431, "headers"),
        ("/health?" + "a" * 100_000, {}, 414, "request line"),
    ],
)
async def test_a_head_over_the_limits_is_a_431_or_414_quoting_nothing_of_it(
    listener: Listener, path: str, headers: dict[str, bytes | str], status: int, field: str
) -> None:
    with anyio.fail_after(20):
        answer = await exchange(listener.url, request_bytes("GET" if "?" in path else "POST", path, headers))
    message = assert_json_error(answer, status, field)
    assert "aaa" not in message and "b'" not in message
    with anyio.fail_after(20):
        assert (await exchange(listener.url, request_bytes("GET", "/health", {}))).status == 200


async def test_a_refused_head_is_answered_while_the_client_goes_on_sending_it(listener: Listener) -> None:
    """The server reads and drops what follows a refused head before it closes: a close with
    unread bytes resets the connection, and the client, still sending, never reads the answer."""
    host, port = address(listener.url)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
    with anyio.fail_after(20):
        async with await anyio.connect_tcp(host, port) as stream:
            await stream.send(head + b"a" * 10_000)  # over the 8,190 bytes of a header line
            answer = await read_response(stream)
            for _ in range(32):  # the rest of its 500 KB header
                await stream.send(b"a" * 16_384)
            await stream.send_eof()
            with pytest.raises(anyio.EndOfStream):  # a clean end, no reset
                await stream.receive()
    assert_json_error(answer, 431, "headers")


# -- expectations -----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/no/such/route"])
async def test_an_unknown_expectation_is_a_json_417(listener: Listener, path: str) -> None:
    raw = request_bytes("POST", path, {**JSON, "Expect": "bogus"}, json.dumps(CHAT).encode())
    with anyio.fail_after(20):
        answer = await exchange(listener.url, raw)
    assert "bogus" in assert_json_error(answer, 417, "Expect")


@pytest.mark.parametrize(
    ("headers", "status", "field"),
    [
        ({"Content-Length": "10000000000"}, 413, "body"),  # 10 GB
        ({"Content-Length": "100", "Content-Encoding": "br"}, 415, "Content-Encoding"),
    ],
)
async def test_a_body_refused_from_its_head_gets_no_100_continue(
    listener: Listener, headers: dict[str, str], status: int, field: str
) -> None:
    raw = request_bytes("POST", "/v1/chat/completions", {**JSON, **headers, "Expect": "100-continue"})
    with anyio.fail_after(20):
        data = await receive_all(listener, raw)
    assert b"100 Continue" not in data and data.startswith(f"HTTP/1.1 {status} ".encode()), data
    body = data.partition(b"\r\n\r\n")[2]
    assert json.loads(body)["error"]["param"] == field


async def test_a_body_within_the_limits_gets_100_continue_then_its_answer(listener: Listener) -> None:
    body = json.dumps({**CHAT, "temperature": 9}).encode()  # read whole, then refused by its field
    host, port = address(listener.url)
    with anyio.fail_after(30):
        async with await anyio.connect_tcp(host, port) as stream:
            head = {**JSON, "Content-Length": str(len(body)), "Expect": "100-continue"}
            await stream.send(request_bytes("POST", "/v1/chat/completions", head))
            continued = await read_response(stream, interim=True)
            await stream.send(body)
            answer = await read_response(stream)
    assert continued.status == 100
    assert_json_error(answer, 400, "temperature")


# -- stream_options without stream ------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {**CHAT, "stream": False, "stream_options": {"include_usage": False}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stream_options": {"include_usage": True}}),
    ],
)
async def test_stream_options_without_stream_is_a_400_naming_it(
    listener: Listener, path: str, body: dict[str, object]
) -> None:
    with anyio.fail_after(30):
        answer = await exchange(listener.url, request_bytes("POST", path, JSON, json.dumps(body).encode()))
    assert "stream" in assert_json_error(answer, 400, "stream_options")
