"""Fuzzing the server below JSON: raw bytes at the socket level (bytes that are not UTF-8 in every
kind of string, content and transfer encodings, odd request lines and headers, heads over the
parser's limits, expectations, compressed bodies whole, cut, padded and over the limit).

The property: every answer is JSON, below 500 (a 4xx is OpenAI's error shape), and the server
answers ``/health`` afterwards with everything released. The cases are drawn from a seeded
generator, the same every run (``RAW_FUZZ_SEED`` and ``RAW_FUZZ_CASES`` for a longer hunt).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.api.connections import ConnectionLimits
from pipeline.api.listener import Listener, listen
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.rawhttp import exchange, request_bytes
from tests.released import assert_released

SEED = int(os.environ.get("RAW_FUZZ_SEED", "22"))
NUM_CASES = int(os.environ.get("RAW_FUZZ_CASES", "24"))  # per family
JSON = {"Content-Type": "application/json"}
# bytes that are never UTF-8, and sequences that start one and break it
BAD_UTF8 = [b"\xff", b"\xfe", b"\xc3(", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xc0\xaf"]
ODD_VALUES = [b"\xff\xfe", "é中".encode(), b"a\x00b", b"\x7f", b" lead", b"tail ", b"", b"a\tb", b"x" * 9000]


def chat_body(rng: random.Random) -> dict[str, object]:
    body: dict[str, object] = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1}
    extra = rng.choice(["", "model", "tools", "response_format", "stop", "logit_bias"])
    if extra == "model":
        body["model"] = "some model"
    elif extra == "tools":
        parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
        body["tools"] = [{"type": "function", "function": {"name": "get", "parameters": parameters}}]
    elif extra == "response_format":
        schema = {"type": "object", "properties": {"name": {"type": "string"}}}
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    elif extra == "stop":
        body["stop"] = ["end here"]
    elif extra == "logit_bias":
        body["logit_bias"] = {"17": 1}
    return body


def with_bad_utf8(rng: random.Random) -> tuple[str, bytes, dict[str, bytes | str]]:
    """A body with bytes that are not UTF-8 inside one of its strings or keys."""
    raw = json.dumps(chat_body(rng)).encode()
    quotes = [i for i, byte in enumerate(raw) if byte == ord('"')]
    at = rng.choice(quotes) + 1  # just inside a string or a key
    return "POST", raw[:at] + rng.choice(BAD_UTF8) + raw[at:], dict(JSON)


def with_encoding(rng: random.Random) -> tuple[str, bytes, dict[str, bytes | str]]:
    """A body under a Content-Encoding it may or may not be in, or a broken chunked framing."""
    raw = json.dumps(chat_body(rng)).encode()
    kind = rng.choice(["plain", "gzip", "deflate", "raw-deflate", "truncated-gzip", "chunked", "bad-chunked"])
    said = rng.choice(["gzip", "deflate", "br", "zstd", "identity", "compress", "gzip, gzip", "GZIP", "\xff"])
    headers: dict[str, bytes | str] = {**JSON, "Content-Encoding": said.encode("latin-1")}
    if kind == "gzip":
        raw = gzip.compress(raw)
    elif kind == "deflate":
        raw = zlib.compress(raw)
    elif kind == "raw-deflate":
        compressor = zlib.compressobj(wbits=-15)
        raw = compressor.compress(raw) + compressor.flush()
    elif kind == "truncated-gzip":
        raw = gzip.compress(raw)[: rng.randrange(1, 20)]
    elif kind in ("chunked", "bad-chunked"):
        del headers["Content-Encoding"]
        headers["Transfer-Encoding"] = "chunked"
        size = f"{len(raw):x}".encode() if kind == "chunked" else rng.choice([b"zz", b"-1", b"f" * 20, b"1;" * 50])
        raw = size + b"\r\n" + raw + b"\r\n0\r\n\r\n"
    return "POST", raw, headers


def with_odd_headers(rng: random.Random) -> tuple[str, bytes, dict[str, bytes | str]]:
    """A valid body under odd headers: values that are not text, odd names, duplicates, many."""
    raw = json.dumps(chat_body(rng)).encode()
    headers: dict[str, bytes | str] = dict(JSON)
    kind = rng.choice(["value", "name", "duplicate-length", "content-type", "many", "authorization", "host"])
    if kind == "value":
        headers["X-Odd"] = rng.choice(ODD_VALUES)
    elif kind == "name":
        headers[rng.choice(["X Space", "X:Colon", "Ünïcode", "X\x01", "(x)"])] = "v"
    elif kind == "duplicate-length":
        headers["Content-Length"] = str(len(raw))
        headers["content-length"] = str(len(raw) + rng.choice([0, 1]))
    elif kind == "content-type":
        headers["Content-Type"] = rng.choice(["text/plain", "application/json; charset=latin-1", "\xff", ""])
    elif kind == "many":
        for i in range(rng.choice([100, 200])):
            headers[f"X-H{i}"] = "v"
    elif kind == "authorization":
        headers["Authorization"] = b"Bearer " + rng.choice(ODD_VALUES)
    else:
        headers["Host"] = rng.choice(ODD_VALUES)
    return "POST", raw, headers


def with_odd_request_line(rng: random.Random) -> tuple[str, bytes, dict[str, bytes | str]]:
    method = rng.choice(["GET", "get", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "G\xffT", "CONNECT"])
    return method, b"", {}


def over_limits(rng: random.Random) -> tuple[str, bytes, dict[str, bytes | str], str]:
    """A head at or over the parser's limits: the URL, a header's name or value, the number of headers."""
    raw = json.dumps(chat_body(rng)).encode()
    size = rng.choice([8000, 8191, 9000, 20_000, 100_000])
    kind = rng.choice(["url", "value", "name", "host", "many"])
    headers: dict[str, bytes | str] = dict(JSON)
    if kind == "url":
        return "GET", b"", {}, "/health?q=" + "a" * size
    if kind == "value":
        headers["X-Big"] = "v" * size
    elif kind == "name":
        headers["X-" + "n" * size] = "v"
    elif kind == "host":
        headers["Host"] = "h" * size
    else:
        for i in range(rng.choice([120, 129, 1000, 10_000])):
            headers[f"X-H{i}"] = "v"
    return "POST", raw, headers, "/v1/chat/completions"


def with_expectation(rng: random.Random) -> tuple[str, bytes, dict[str, bytes | str]]:
    """An ``Expect`` header, met or not, with a body whole or one too large to send."""
    raw = json.dumps(chat_body(rng)).encode()
    expect = rng.choice(["100-continue", "100-CONTINUE", "bogus", "100-continue, x", "\xff", "200-ok"])
    headers: dict[str, bytes | str] = {**JSON, "Expect": expect.encode("latin-1")}
    if rng.random() < 0.4:  # a body over the limit, never sent
        headers["Content-Length"] = str(rng.choice([(1 << 20) + 1, 10**10, 2**63 - 1]))
        return "POST", b"", headers
    if rng.random() < 0.3:
        headers["Content-Encoding"] = rng.choice(["br", "zstd", "gzip"])
        raw = gzip.compress(raw) if headers["Content-Encoding"] == "gzip" else raw
    return "POST", raw, headers


def compressed(rng: random.Random) -> tuple[str, bytes, dict[str, bytes | str]]:
    """A compressed body: whole, in members, padded, cut, trailed by junk, or a bomb over the limit."""
    raw = json.dumps(chat_body(rng)).encode()
    kind = rng.choice(["gzip", "members", "padded", "junk", "cut", "bomb", "nested", "raw-deflate", "chunked"])
    encoding = "deflate" if kind == "raw-deflate" else "gzip"
    if kind == "members":
        body = gzip.compress(raw[:7]) + gzip.compress(raw[7:])
    elif kind == "padded":
        body = gzip.compress(raw) + b"\0" * rng.randrange(1, 600)
    elif kind == "junk":
        body = gzip.compress(raw) + rng.randbytes(rng.randrange(1, 40))
    elif kind == "cut":
        whole = gzip.compress(raw)
        body = whole[: rng.randrange(1, len(whole))]
    elif kind == "bomb":  # over the 1 MiB body limit once inflated
        body = gzip.compress(b'{"messages": "' + b"a" * rng.choice([1 << 20, 16 << 20]) + b'"}')
    elif kind == "nested":
        body = gzip.compress(gzip.compress(raw))
    elif kind == "raw-deflate":
        packer = zlib.compressobj(wbits=-15)
        body = packer.compress(raw) + packer.flush()
    else:
        body = gzip.compress(raw)
    headers: dict[str, bytes | str] = {**JSON, "Content-Encoding": encoding}
    if kind == "chunked":
        headers["Transfer-Encoding"] = "chunked"
        body = f"{len(body):x}".encode() + b"\r\n" + body + b"\r\n0\r\n\r\n"
    return "POST", body, headers


Made = tuple[str, bytes, dict[str, bytes | str]] | tuple[str, bytes, dict[str, bytes | str], str]
FAMILIES: dict[str, Callable[[random.Random], Made]] = {
    "utf8": with_bad_utf8,
    "encoding": with_encoding,
    "headers": with_odd_headers,
    "method": with_odd_request_line,
    "limits": over_limits,
    "expect": with_expectation,
    "compressed": compressed,
}
PATHS = ["/v1/chat/completions", "/health", "/v1/models", "/v1/chat/completions?x=\xff", "/nope", "//v1/models"]


@dataclass
class Target:
    pipe: Pipeline
    listener: Listener


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def target() -> AsyncIterator[Target]:
    config = PipelineConfig(
        max_running_seqs=2, num_kv_blocks=64, max_model_len=512, preparation_mode="thread", engine_mode="thread"
    )
    limits = ConnectionLimits(header_timeout_s=5.0)
    async with Pipeline(config) as pipe, listen(create_app(pipe, max_body_bytes=1 << 20), limits=limits) as listener:
        yield Target(pipe, listener)
        await assert_released(pipe)


def cases(family: str) -> list[tuple[str, bytes]]:
    rng = random.Random(f"{SEED}-{family}")
    out = []
    for i in range(NUM_CASES):
        method, body, headers, *chosen = FAMILIES[family](rng)
        path = chosen[0] if chosen else "/v1/chat/completions" if method == "POST" else rng.choice(PATHS)
        raw = request_bytes(method, path, {**headers, "Connection": "close"}, body)
        out.append((f"{family}-{i}", raw))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_raw_bytes_get_json_below_500(target: Target, family: str) -> None:
    statuses = []
    for name, raw in cases(family):
        with anyio.fail_after(30):
            answer = await exchange(target.listener.url, raw)
        statuses.append(answer.status)
        assert answer.status < 500, (name, raw[:300], answer)
        if raw.startswith(b"HEAD "):
            continue  # a head only
        assert answer.headers.get("content-type", "").startswith("application/json"), (name, raw[:300], answer)
        payload = answer.json()
        if answer.status >= 400:
            error = payload["error"]
            assert set(error) >= {"message", "type", "param", "code"} and error["message"], (name, error)
    assert any(status >= 400 for status in statuses)  # the family reached a refusal
    with anyio.fail_after(30):
        health = await exchange(target.listener.url, request_bytes("GET", "/health", {"Connection": "close"}))
    assert health.status == 200
