"""A hostile client at the socket level: bounded connections, broken encodings, malformed HTTP.

Two listeners over one pipeline: one with the default limits, one with a small cap and a short
header deadline so that the bounds are reached in a test.
"""

from __future__ import annotations

import gzip
import json
import logging
import resource
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import pytest
from anyio.abc import SocketStream
from prometheus_client.parser import text_string_to_metric_families

from pipeline import PipelineConfig
from pipeline.api.connections import ConnectionLimits, raise_fd_limit
from pipeline.api.listener import Listener, listen
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.rawhttp import RawResponse, address, exchange, request_bytes

SMALL = ConnectionLimits(max_connections=8, reserved_connections=2, header_timeout_s=1.0, log_interval_s=3600)
CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
JSON = {"Content-Type": "application/json"}


@dataclass
class Servers:
    pipe: Pipeline
    default: Listener
    small: Listener


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def servers() -> AsyncIterator[Servers]:
    config = PipelineConfig(
        max_running_seqs=2, num_kv_blocks=64, max_model_len=512, preparation_mode="thread", engine_mode="thread"
    )
    async with (
        Pipeline(config) as pipe,
        listen(create_app(pipe, max_body_bytes=1 << 20)) as default,
        listen(create_app(pipe), limits=SMALL) as small,
    ):
        yield Servers(pipe, default, small)


def assert_json_error(answer: RawResponse, status: int, field: str | None) -> None:
    assert answer.status == status, answer
    assert answer.headers["content-type"].startswith("application/json"), answer
    error = answer.json()["error"]
    assert error["param"] == field and error["message"], error


async def connect(listener: Listener) -> SocketStream:
    host, port = address(listener.url)
    return await anyio.connect_tcp(host, port)


async def until_closed(stream: SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while True:
        try:
            data += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return data


async def receive_head(stream: SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive()
    return data


async def health(listener: Listener) -> RawResponse:
    return await exchange(listener.url, request_bytes("GET", "/health", {"Connection": "close"}))


# -- bounded connections ----------------------------------------------------------------------
async def test_slow_heads_beyond_the_cap_leave_health_answering(servers: Servers) -> None:
    listener = servers.small
    guard = listener.guard
    before = (guard.stats.evicted, guard.stats.header_timeouts)
    num_slow = 3 * SMALL.max_connections
    slow: list[SocketStream] = []
    with anyio.fail_after(30):
        for _ in range(num_slow):  # a request line and one header, then nothing
            stream = await connect(listener)
            await stream.send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            slow.append(stream)
        answer = await health(listener)
        assert answer.status == 200 and answer.json()["status"] == "ok"
        assert guard.num_open <= SMALL.max_connections
        endings = [await until_closed(stream) for stream in slow]  # the server closes every one
        for stream in slow:
            await stream.aclose()
    timed_out = [e for e in endings if e]
    assert all(e.startswith(b"HTTP/1.1 408 ") for e in timed_out)
    evicted, header_timeouts = guard.stats.evicted - before[0], guard.stats.header_timeouts - before[1]
    assert header_timeouts == len(timed_out) >= 1
    assert evicted + header_timeouts == num_slow  # each closed once: to make room, or at the deadline
    assert guard.stats.refused == 0  # a waiting connection was always there to make room


async def test_a_reserve_connection_answers_health_only(servers: Servers) -> None:
    listener = servers.small
    general = SMALL.max_connections - SMALL.reserved_connections
    busy: list[SocketStream] = []
    with anyio.fail_after(30):
        for _ in range(general):  # heads whole, bodies never sent: each holds a general slot
            stream = await connect(listener)
            head = {"Content-Length": "100", "Expect": "100-continue", **JSON}
            await stream.send(request_bytes("POST", "/v1/chat/completions", head))
            assert (await receive_head(stream)).startswith(b"HTTP/1.1 100 ")  # the app has the request
            busy.append(stream)
        refusals = listener.guard.stats.reserve_refusals
        answer = await exchange(listener.url, request_bytes("POST", "/v1/chat/completions", JSON, CHAT))
        assert_json_error(answer, 429, None)
        assert answer.json()["error"]["code"] == "overloaded" and answer.headers["connection"] == "close"
        assert listener.guard.stats.reserve_refusals == refusals + 1
        assert (await health(listener)).status == 200
        for stream in busy:
            await stream.aclose()


async def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft == hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft // 2, 256), hard))
    try:
        assert raise_fd_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert hard == resource.RLIM_INFINITY or resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- bodies and heads aiohttp refused or raised on ----------------------------------------------
@pytest.mark.parametrize(
    ("encoding", "status"),
    [("gzip", 400), ("deflate", 400), ("br", 415), ("zstd", 415), ("x-unknown", 415), ("gzip, deflate", 415)],
)
async def test_a_body_that_is_not_in_its_content_encoding_is_refused(
    servers: Servers, encoding: str, status: int
) -> None:
    headers = {**JSON, "Content-Encoding": encoding}
    answer = await exchange(servers.default.url, request_bytes("POST", "/v1/chat/completions", headers, CHAT))
    assert_json_error(answer, status, "Content-Encoding")
    assert "install" not in answer.json()["error"]["message"]  # no word of a package the server lacks
    assert (await health(servers.default)).status == 200


async def test_a_compressed_body_is_read(servers: Servers) -> None:
    headers = {**JSON, "Content-Encoding": "gzip"}
    raw = request_bytes("POST", "/v1/chat/completions", headers, gzip.compress(CHAT))
    assert (await exchange(servers.default.url, raw)).status == 200


@pytest.mark.parametrize(
    ("head", "field"),
    [
        ({"Content-Length": "2", "content-length": "2"}, "Content-Length"),
        ({"Content-Length": "-1"}, "Content-Length"),
        ({"Transfer-Encoding": "chunked, identity"}, "Transfer-Encoding"),
        ({"Bad Name": "x"}, "headers"),
        ({"X-Nul": b"a\x00b"}, "headers"),
    ],
)
async def test_malformed_http_gets_a_json_400(servers: Servers, head: dict[str, bytes | str], field: str) -> None:
    answer = await exchange(servers.default.url, request_bytes("POST", "/v1/chat/completions", head, b"{}"))
    assert_json_error(answer, 400, field)
    assert answer.json()["error"]["message"].startswith("malformed HTTP request")
    assert (await health(servers.default)).status == 200


@pytest.mark.parametrize(
    "line", [b"G\xffT /health HTTP/1.1", b"GET /health HTTP/9.9", b"GET  HTTP/1.1", b"\x16\x03\x01"]
)
async def test_a_malformed_request_line_gets_a_json_400(servers: Servers, line: bytes) -> None:
    answer = await exchange(servers.default.url, line + b"\r\nHost: x\r\n\r\n")
    assert_json_error(answer, 400, "request line")


async def test_head_health_answers_like_get_without_a_body(servers: Servers) -> None:
    host, port = address(servers.default.url)
    async with await anyio.connect_tcp(host, port) as stream:
        await stream.send(request_bytes("HEAD", "/health", {}))
        data = await receive_head(stream)
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 200 OK"
    headers = dict(line.split(b": ", 1) for line in rest.split(b"\r\n\r\n")[0].split(b"\r\n"))
    get = await health(servers.default)
    assert int(headers[b"Content-Length"]) == len(get.body) and data.endswith(b"\r\n\r\n")


async def test_an_internal_error_carries_the_id_its_log_line_carries(
    servers: Servers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> dict[str, object]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(servers.pipe, "health", broken)
    with caplog.at_level(logging.ERROR, logger="pipeline.api.server"):
        answer = await health(servers.default)
    assert answer.status == 500
    request_id = answer.json()["error"]["request_id"]
    assert isinstance(request_id, str) and request_id.startswith("req-")
    [record] = [r for r in caplog.records if r.name == "pipeline.api.server"]
    assert request_id in record.getMessage() and record.exc_info is not None


async def test_a_pipelined_request_after_a_response_is_answered(servers: Servers) -> None:
    # keep-alive and pipelining still work under the guard
    host, port = address(servers.default.url)
    async with await anyio.connect_tcp(host, port) as stream:
        await stream.send(
            request_bytes("GET", "/health", {}) + request_bytes("GET", "/health", {"Connection": "close"})
        )
        data = await until_closed(stream)
    assert data.count(b"HTTP/1.1 200 OK\r\n") == 2


async def test_metrics_sum_the_listeners_of_one_pipeline(servers: Servers) -> None:
    """Two listeners serve one pipeline: each family appears once in its exposition, over both."""
    with anyio.fail_after(30):
        answer = await exchange(servers.small.url, request_bytes("GET", "/metrics", {}))
    assert answer.status == 200
    text = answer.body.decode()
    assert text.count("# TYPE pipeline_http_connections_open gauge") == 1
    samples = {
        (s.name, tuple(s.labels.values())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    opened = servers.default.guard.stats.opened + servers.small.guard.stats.opened
    assert samples[("pipeline_http_connections_total", ("opened",))] == opened >= 1
    paced = servers.default.bodies.stats.bodies + servers.small.bodies.stats.bodies
    assert samples[("pipeline_http_bodies_paced_total", ())] == paced
