"""Fuzzing the server below JSON: raw bytes at the socket level (bytes that are not UTF-8 in every
kind of string, content and transfer encodings, odd request lines and headers).

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


FAMILIES: dict[str, Callable[[random.Random], tuple[str, bytes, dict[str, bytes | str]]]] = {
    "utf8": with_bad_utf8,
    "encoding": with_encoding,
    "headers": with_odd_headers,
    "method": with_odd_request_line,
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
        method, body, headers = FAMILIES[family](rng)
        path = "/v1/chat/completions" if method == "POST" else rng.choice(PATHS)
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
