"""A corpus of malformed requests over HTTP: each gets a 4xx naming the field; the server stays healthy."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from pipeline import PipelineConfig
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.images import TIFF_FLOAT, data_url, encode, make_image, png_header, tiff_with_strip_offsets
from tests.released import assert_released
from tests.servers import serving

URL = "messages[0].content[1].image_url.url"


def msg(*parts: Any, role: str = "user") -> dict[str, Any]:
    return {"messages": [{"role": role, "content": list(parts)}]}


def img(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "look"}
OK = {"messages": [{"role": "user", "content": "hi"}]}
PNG = encode(make_image(32, 32, seed=1))
TIFF = tiff_with_strip_offsets(TIFF_FLOAT)
MISSING_REF = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}

CORPUS: list[tuple[str, Any, int, str]] = [
    ("not json", b"{nope", 400, "body"),
    ("json array", [], 400, "body"),
    ("no messages", {}, 400, "messages"),
    ("messages not a list", {"messages": "hi"}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("message not an object", {"messages": ["hi"]}, 400, "messages[0]"),
    ("no role", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("bogus role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("no content", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("numeric content", {"messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content"),
    ("empty content list", {"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),
    ("part not an object", msg("text"), 400, "messages[0].content[0]"),
    ("unknown part type", msg({"type": "video"}), 400, "messages[0].content[0].type"),
    ("text not a string", msg({"type": "text", "text": ["a"]}), 400, "messages[0].content[0].text"),
    ("image_url without url", msg(TEXT, {"type": "image_url", "image_url": {}}), 400, URL),
    ("empty url", msg(TEXT, img("")), 400, URL),
    ("broken base64", msg(TEXT, img("data:image/png;base64,iVBORw0K%%%GgoAAA")), 400, URL),
    ("data URL not an image", msg(TEXT, img("data:text/plain;base64,aGVsbG8=")), 400, URL),
    ("data URL not base64", msg(TEXT, img("data:image/png,rawbytes")), 400, URL),
    ("text file called .png", msg(TEXT, img(data_url(b"just some text, honestly"))), 400, URL),
    ("truncated png", msg(TEXT, img(data_url(PNG[: len(PNG) // 2]))), 400, URL),
    ("20000x20000 png", msg(TEXT, img(data_url(png_header(20_000, 20_000)))), 413, URL),
    ("empty image", msg(TEXT, img("data:image/png;base64,")), 400, URL),
    ("too many images", msg(TEXT, *[img(data_url(PNG))] * 9), 400, "messages"),
    ("image in a system message", msg(img(data_url(PNG)), role="system"), 400, "messages[0].content"),
    ("ftp url", msg(TEXT, img("ftp://example.com/a.png")), 400, URL),
    ("local file without media root", msg(TEXT, img("file:///etc/passwd")), 400, URL),
    ("loopback url", msg(TEXT, img("http://127.0.0.1:9/a.png")), 400, URL),
    ("link-local url", msg(TEXT, img("http://169.254.169.254/latest/meta-data")), 400, URL),
    ("unknown response_format", {**OK, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("response_format not an object", {**OK, "response_format": "json"}, 400, "response_format"),
    ("json_schema missing", {**OK, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    (
        "schema that is not JSON",
        {**OK, "response_format": {"type": "json_schema", "json_schema": {"schema": "{a:"}}},
        400,
        "response_format.json_schema.schema",
    ),
    (
        "schema false (nothing satisfies it)",
        {**OK, "response_format": {"type": "json_schema", "json_schema": {"schema": False}}},
        400,
        "response_format.json_schema.schema",
    ),
    (
        "schema that is a bare cycle",
        {**OK, "response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}},
        400,
        "response_format.json_schema.schema",
    ),
    (
        "a vLLM-only field we do not honour",
        {**OK, "guided_whitespace_pattern": "[ ]?"},
        400,
        "guided_whitespace_pattern",
    ),
    (
        "an unknown field",
        {**OK, "frobnicate": True},
        400,
        "frobnicate",
    ),
    (
        "two constraints",
        {**OK, "guided_regex": "a+", "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    (
        "schema that is a list",
        {**OK, "response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
        400,
        "response_format.json_schema.schema",
    ),
    (
        "strict not a boolean",
        {**OK, "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}}},
        400,
        "response_format.json_schema.strict",
    ),
    (
        "strict schema with a remote $ref (nothing can hold it)",
        {
            **OK,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "array", "items": {"$ref": "https://example.com/s.json"}}},
            },
        },
        400,
        "response_format.json_schema.schema",
    ),
    (
        "contradictory schema",
        {
            **OK,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "string", "minLength": 5, "maxLength": 2}},
            },
        },
        400,
        "response_format.json_schema.schema",
    ),
    ("regex with lookahead", {**OK, "regex": "(?=x)x"}, 400, "regex"),
    ("regex with backreference", {**OK, "regex": "(a)\\1"}, 400, "regex"),
    ("broken EBNF", {**OK, "grammar": "root ::= ("}, 400, "grammar"),
    ("empty choice", {**OK, "choice": []}, 400, "choice"),
    ("choice with a number", {**OK, "choice": ["a", 2]}, 400, "choice"),
    ("regex and grammar", {**OK, "regex": "a", "grammar": 'root ::= "a"'}, 400, "grammar"),
    ("negative max_tokens", {**OK, "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens a string", {**OK, "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens too large", {**OK, "max_tokens": 10**9}, 400, "max_tokens"),
    ("n = 0", {**OK, "n": 0}, 400, "n"),
    ("n = 100", {**OK, "n": 100}, 400, "n"),
    ("negative temperature", {**OK, "temperature": -1}, 400, "temperature"),
    ("top_p = 0", {**OK, "top_p": 0}, 400, "top_p"),
    ("seed a float", {**OK, "seed": 1.5}, 400, "seed"),
    ("too many stop strings", {**OK, "stop": [str(i) for i in range(20)]}, 400, "stop"),
    ("stream not a boolean", {**OK, "stream": "true"}, 400, "stream"),
    ("last message from the assistant", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages[0].role"),
    ("prompt too long", {"messages": [{"role": "user", "content": "word " * 3000}]}, 400, "messages"),
    # typed control tokens are text, each at least one token: more of them than a prompt holds
    (
        "image tokens typed past the prompt's length",
        {"messages": [{"role": "user", "content": "[IMG]" * 1100}]},
        400,
        "messages",
    ),
    # the template writes a system message only before a user's: the prompt was "<s>" alone, answered
    ("a system message alone", {"messages": [{"role": "system", "content": "Be brief."}]}, 400, "messages"),
    ("a TIFF whose strip offsets are a float", msg(TEXT, img(data_url(TIFF, "image/tiff"))), 400, URL),
    ("2,049 messages", {"messages": [{"role": "user", "content": "hi"}] * 2049}, 400, "messages"),
    (
        "129 tools",
        {**OK, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
        400,
        "tools",
    ),
    (
        "content parts past the bound",
        {"messages": [{"role": "user", "content": [TEXT] * 8193}]},
        400,
        "messages[0].content",
    ),
    (
        "a tool's $ref to nothing",
        {**OK, "tools": [{"type": "function", "function": {"name": "f", "parameters": MISSING_REF}}]},
        400,
        "tools[0].function.parameters",
    ),
    (
        "text no prompt can hold",
        {"messages": [{"role": "user", "content": "x" * (1024 * 76 * 4 + 1)}]},
        400,
        "messages",
    ),
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


# the entries whose bytes reach an image decoder: a worker process's, or a thread's
DECODED = {
    "text file called .png",
    "truncated png",
    "20000x20000 png",
    "empty image",
    "a TIFF whose strip offsets are a float",
}
DECODED_CORPUS = [c for c in CORPUS if c[0] in DECODED]


@asynccontextmanager
async def serving_pipeline(mode: str) -> AsyncIterator[tuple[str, Pipeline]]:
    config = PipelineConfig(
        max_prompt_tokens=1024,
        max_running_seqs=4,
        num_kv_blocks=256,
        max_model_len=2048,
        preparation_mode=mode,
        engine_mode="thread",
    )
    async with Pipeline(config) as pipe, serving(create_app(pipe)) as base:
        yield base, pipe


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[tuple[str, Pipeline]]:
    async with serving_pipeline("process") as server:
        yield server


@pytest.fixture(scope="module")
async def thread_served() -> AsyncIterator[tuple[str, Pipeline]]:
    async with serving_pipeline("thread") as server:
        yield server


def test_the_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 40
    assert DECODED <= {c[0] for c in CORPUS}


async def check_refused(served: tuple[str, Pipeline], body: Any, status: int, field: str) -> None:
    server, pipe = served
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{server}/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
        ) as resp:
            payload = await resp.json()
            assert resp.status == status, payload
        error = payload["error"]
        assert error["param"] == field, error
        assert error["message"] and error["type"]
        async with session.get(f"{server}/health") as health:
            assert health.status == 200 and (await health.json())["status"] == "ok"
        # and the server still serves a good request
        async with session.post(f"{server}/v1/chat/completions", json={**OK, "max_tokens": 1}) as resp:
            assert resp.status == 200
    await assert_released(pipe)  # a refused request leaves the stages at their next boundary


@pytest.mark.parametrize(("name", "body", "status", "field"), CORPUS, ids=[c[0] for c in CORPUS])
async def test_bad_input_gets_a_4xx_naming_the_field(
    served: tuple[str, Pipeline], name: str, body: Any, status: int, field: str
) -> None:
    await check_refused(served, body, status, field)


@pytest.mark.parametrize(("name", "body", "status", "field"), DECODED_CORPUS, ids=[c[0] for c in DECODED_CORPUS])
async def test_bad_images_decoded_in_threads_too(
    thread_served: tuple[str, Pipeline], name: str, body: Any, status: int, field: str
) -> None:
    await check_refused(thread_served, body, status, field)
