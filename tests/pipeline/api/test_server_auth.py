"""API keys with the real ``openai`` client: ``/v1/*`` needs the key; probes stay open unless asked."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST

from pipeline import PipelineConfig
from pipeline.api.auth import API_KEY_ENV, api_key_refusal, resolve_api_key
from pipeline.api.openapi import openapi_json
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.rawhttp import exchange, request_bytes
from tests.servers import serving

KEY = "sk-test-0123456789"
MESSAGES = [{"role": "user", "content": "x"}]


async def assert_probes_answer(session: aiohttp.ClientSession, base: str, pipe: Pipeline, **headers: str) -> None:
    """/health, /metrics and /openapi.json answer 200 with what the pipeline says (it is idle)."""
    async with session.get(f"{base}/health", headers=headers) as resp:
        assert (resp.status, resp.content_type) == (200, "application/json")
        assert await resp.json() == pipe.health() and pipe.health()["status"] == "ok"
    async with session.get(f"{base}/metrics", headers=headers) as resp:
        assert (resp.status, resp.headers["Content-Type"]) == (200, CONTENT_TYPE_LATEST)
        assert await resp.read() == pipe.render_metrics()
    async with session.get(f"{base}/openapi.json", headers=headers) as resp:
        assert (resp.status, resp.content_type) == (200, "application/json")
        assert await resp.read() == openapi_json()


async def assert_refused(resp: aiohttp.ClientResponse) -> None:
    """A 401 in OpenAI's shape, naming the header."""
    assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
    error = (await resp.json())["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_api_key",
        "Authorization",
    )


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pipe() -> AsyncIterator[Pipeline]:
    config = PipelineConfig(
        max_running_seqs=2,
        num_kv_blocks=64,
        max_model_len=512,
        served_model_names=("m",),
        preparation_mode="thread",
        engine_mode="thread",
    )
    async with Pipeline(config) as pipe:
        yield pipe


async def test_v1_needs_the_key_in_openai_shape(pipe: Pipeline) -> None:
    async with serving(create_app(pipe, api_key=KEY)) as base:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0) as client:
            out = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
            assert out.choices[0].finish_reason in ("stop", "length")
            stream = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1, stream=True)  # type: ignore[arg-type]
            assert [chunk async for chunk in stream]
            assert [m.id for m in (await client.models.list()).data] == ["m"]
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError) as info:
                await wrong.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
            assert isinstance(info.value.body, dict) and info.value.body["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.list()
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES}) as resp:
                await assert_refused(resp)
            await assert_probes_answer(session, base, pipe)


async def test_probes_can_be_protected_too(pipe: Pipeline) -> None:
    async with serving(create_app(pipe, api_key=KEY, protect_all=True)) as base, aiohttp.ClientSession() as session:
        for path in ("/health", "/metrics", "/openapi.json"):
            async with session.get(f"{base}{path}") as resp:
                await assert_refused(resp)
        await assert_probes_answer(session, base, pipe, Authorization=f"Bearer {KEY}")


def test_the_key_comes_from_the_command_line_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("from-cli") == "from-cli"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert resolve_api_key(None) is None


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_scheme_is_case_insensitive(scheme: str) -> None:
    assert api_key_refusal(KEY, "/v1/models", f"{scheme} {KEY}") is None


@pytest.mark.parametrize(
    "authorization",
    [
        "Basic " + KEY,
        KEY,
        "Bearer",
        "Bearer " + KEY + "x",
        # aiohttp reads header bytes that are not UTF-8 as escaped surrogates
        b"Bearer \xff\xfe\xc3(".decode("utf-8", "surrogateescape"),
        "Bearer sk-\u00e9\u4e2d",
    ],
)
def test_a_wrong_or_undecodable_key_is_a_401(authorization: str) -> None:
    refusal = api_key_refusal(KEY, "/v1/models", authorization)
    assert refusal is not None and refusal.status == 401


async def test_non_ascii_bytes_in_the_header_are_a_401_over_http(pipe: Pipeline) -> None:
    async with serving(create_app(pipe, api_key=KEY)) as base:
        for value in (b"Bearer \xff\xfe\x80", "Bearer sk-é".encode(), b"bearer " + KEY.encode()):
            answer = await exchange(base, request_bytes("GET", "/v1/models", {"Authorization": value}))
            expected = 200 if value.startswith(b"bearer ") else 401
            assert answer.status == expected, (value, answer.body)
            if expected == 401:
                assert answer.json()["error"]["code"] == "invalid_api_key"
